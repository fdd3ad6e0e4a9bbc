"""The baselines of `fauxmad bench jobs`: the seed's Redis BLPOP queue, arq (a Python job queue on Redis), and
the plainest queue on JetStream (the floor under fauxmad's queue, on the same kind of nats-server).

Each runs as worker processes doing what a fauxmad worker does with a job: take it, run its command as a
child process (output captured), record when it was taken, started and finished. `python -m
lab.bench.jobs_peers redis|arq|jetstream URL SLOTS` is one worker with SLOTS jobs at a time. Redis and arq
are the optional extra `jobs-bench`, imported only here, at run time.

The JetStream queue is a work-queue stream (`JS_STREAM`: a message is a job until a worker acks it) with one
durable pull consumer the workers share; each slot fetches one job, runs it, publishes its record on the core
subject `JS_DONE` and acks. Nothing else: no job record in a bucket, no events, no cancel or keys, which
fauxmad's queue has. The submitter publishes each job to the stream and awaits its ack (stored: every write
flushed on a fleet's nats-server).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

QUEUE = "fauxmad-bench:queue"
DONE = "fauxmad-bench:done"
JS_STREAM = "FAUXMAD_BENCH_QUEUE"
JS_SUBJECT = "fauxmad-bench.queue"
JS_DONE = "fauxmad-bench.done"
JS_CONSUMER = "workers"
ARQ_POLL_DELAY = 0.005  # arq polls its queue (default 0.5 s): the shortest that does not spin


async def run_command(cmd: list[str]) -> tuple[float, int]:
    """(when it started, its exit code)."""
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    started = time.time()
    await proc.communicate()
    return started, proc.returncode or 0


async def redis_worker(url: str, slots: int) -> None:
    """The seed's pull API: BLPOP a job, run it, push its record on the done list."""
    import redis.asyncio as aioredis

    client: Any = aioredis.from_url(url)  # type: ignore[no-untyped-call]

    async def slot() -> None:
        while True:
            _, raw = await client.blpop([QUEUE])
            job = json.loads(raw)
            claimed = time.time()
            started, code = await run_command(job["cmd"])
            record = {"id": job["id"], "claimed": claimed, "started": started, "finished": time.time(), "exit": code}
            await client.rpush(DONE, json.dumps(record))

    await asyncio.gather(*(slot() for _ in range(slots)))


async def jetstream_worker(url: str, slots: int) -> None:
    """The plainest JetStream queue's worker: each slot fetches one job, runs it, says so on JS_DONE, acks."""
    import nats
    from nats.errors import TimeoutError as FetchTimeout

    nc = await nats.connect(url)
    queue = await nc.jetstream().pull_subscribe(JS_SUBJECT, durable=JS_CONSUMER, stream=JS_STREAM)

    async def slot() -> None:
        while True:
            try:
                (msg,) = await queue.fetch(1, timeout=5)
            except FetchTimeout:
                continue
            job = json.loads(msg.data)
            claimed = time.time()
            started, code = await run_command(job["cmd"])
            record = {"id": job["id"], "claimed": claimed, "started": started, "finished": time.time(), "exit": code}
            await nc.publish(JS_DONE, json.dumps(record).encode())
            await msg.ack()

    await asyncio.gather(*(slot() for _ in range(slots)))


class JetStreamQueue:
    """The JetStream queue's client side. `await JetStreamQueue.prepare(url)` makes the stream and the workers'
    consumer (before the workers start); then `async with JetStreamQueue(url) as queue:` and `await
    queue.batch(jobs, timeout)` submits jobs (each publish's ack awaited, all at once) and returns the records
    their workers sent, as many as jobs."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.nc: Any = None
        self.done: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    @staticmethod
    async def prepare(url: str) -> None:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            config = StreamConfig(
                name=JS_STREAM, subjects=[JS_SUBJECT], retention=RetentionPolicy.WORK_QUEUE, storage=StorageType.FILE
            )
            await js.add_stream(config)
            await js.add_consumer(JS_STREAM, ConsumerConfig(durable_name=JS_CONSUMER, ack_policy=AckPolicy.EXPLICIT))
        finally:
            await nc.close()

    async def __aenter__(self) -> JetStreamQueue:
        import nats

        self.nc = await nats.connect(self.url)

        async def on_done(msg: Any) -> None:
            self.done.put_nowait(json.loads(msg.data))

        await self.nc.subscribe(JS_DONE, cb=on_done)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def batch(self, jobs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
        js = self.nc.jetstream()
        await asyncio.gather(*(js.publish(JS_SUBJECT, json.dumps(job).encode()) for job in jobs))
        records: dict[Any, dict[str, Any]] = {}
        while len(records) < len(jobs):  # each job's record once (a job delivered again would send a second)
            record = await asyncio.wait_for(self.done.get(), timeout)
            records.setdefault(record["id"], record)
        return [records[job["id"]] for job in jobs]


async def arq_run(ctx: dict[str, Any], cmd: list[str]) -> dict[str, Any]:
    claimed = time.time()
    started, code = await run_command(cmd)
    return {"claimed": claimed, "started": started, "finished": time.time(), "exit": code}


def arq_worker(url: str, slots: int) -> None:
    from arq.connections import RedisSettings
    from arq.worker import Worker

    worker = Worker(
        functions=[arq_run],  # type: ignore[list-item]
        redis_settings=RedisSettings.from_dsn(url),
        max_jobs=slots,
        poll_delay=ARQ_POLL_DELAY,
        keep_result=3600,
        handle_signals=True,
    )
    worker.run()


if __name__ == "__main__":
    kind, dsn, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kind == "redis":
        asyncio.run(redis_worker(dsn, count))
    elif kind == "jetstream":
        asyncio.run(jetstream_worker(dsn, count))
    else:
        arq_worker(dsn, count)
