"""The baselines of `fauxmad bench jobs`: the seed's Redis BLPOP queue, and arq (a Python job queue on Redis).

Each runs as worker processes doing what a fauxmad worker does with a job: take it, run its command as a
child process (output captured), record when it was taken, started and finished. `python -m
lab.bench.jobs_peers redis|arq URL SLOTS` is one worker with SLOTS jobs at a time. Redis and arq
are the optional extra `jobs-bench`, imported only here, at run time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

QUEUE = "fauxmad-bench:queue"
DONE = "fauxmad-bench:done"
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
    else:
        arq_worker(dsn, count)
