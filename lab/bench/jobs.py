"""`fauxmad bench jobs`: background jobs side by side with the seed's Redis BLPOP queue, with arq, and with the
plainest queue on JetStream (`lab.bench.jobs_peers`: the floor under fauxmad's queue on the same kind of server).

Each system gets the same work, one after the other (never at once): W worker processes with S slots
each, a trivial command (`true`) run as a child process per task, output captured. Two measurements:
- throughput: one burst of `tasks` submitted at once, timed from the submit to the last task finished;
- scheduling delay with free capacity: `samples` tasks submitted one at a time, each waited for, timed
  from the submit (the client's clock) to the task taken by a worker and to its process running.
fauxmad's NATS is its dev fleet's: every JetStream write flushed to disk (`sync_interval: always`), unless
`nats_sync` is off (NATS's default: flushed every two minutes); Redis runs as `redis-server --save ''
--appendonly no` (no disk at all), so the comparison favours it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
import uvloop

from bus.contract.jobs import JobSubmitRequest
from bus.local.embedded import EmbeddedNats
from bus.local.ports import free_port
from lab.bench.report import Report, Table, host_info, latency_table
from lab.bench.stats import Latency, summarize
from orchestrator.devfleet import ROOT, DevFleet, FleetSpec
from orchestrator.jobs.client import JobsClient

INSTALL_HINT = "pip install -e '.[jobs-bench]'"
REGION = "bench"


class JobsBenchOptions(msgspec.Struct, frozen=True, kw_only=True):
    tasks: int = 1000
    samples: int = 200  # one at a time, with free capacity
    workers: int = 4
    slots: int = 4  # per worker
    runner: str = "process"  # fauxmad's: "process" (the fast path) or "machine"
    cmd: list[str] = msgspec.field(default_factory=lambda: ["true"])
    baselines: bool = True
    nats_sync: bool = True  # every JetStream write flushed before its ack (what fauxmad ships); False: NATS's default
    timeout: float = 600.0


class SystemResult(msgspec.Struct, kw_only=True):
    system: str
    tasks: int
    seconds: float
    tasks_per_s: float
    free_taken: Latency  # submit -> taken by a worker, capacity free
    free_running: Latency  # submit -> its process running, capacity free
    burst_taken: Latency  # submit -> taken, in the burst (includes waiting for a slot)


class JobsBenchResult(msgspec.Struct, kw_only=True):
    options: JobsBenchOptions
    systems: list[SystemResult]
    skipped: list[str]
    host: dict[str, Any]


class Timing(msgspec.Struct, frozen=True):
    submitted: float
    claimed: float
    started: float
    finished: float


def result_of(system: str, tasks: int, start: float, burst: list[Timing], free: list[Timing]) -> SystemResult:
    end = max(t.finished for t in burst)
    return SystemResult(
        system=system,
        tasks=tasks,
        seconds=round(end - start, 3),
        tasks_per_s=round(tasks / (end - start), 1),
        free_taken=summarize([t.claimed - t.submitted for t in free]),
        free_running=summarize([t.started - t.submitted for t in free]),
        burst_taken=summarize([t.claimed - t.submitted for t in burst]),
    )


Batch = Callable[[int], Awaitable[tuple[float, list[Timing]]]]  # submit n, wait for all: (submitted at, timings)


async def measured(system: str, batch: Batch, options: JobsBenchOptions) -> SystemResult:
    """Every system's same work through its `batch`: a warm-up (every worker has run tasks), `samples` tasks one
    at a time, then `tasks` at once."""
    await batch(min(50, options.tasks))
    free = [(await batch(1))[1][0] for _ in range(options.samples)]
    start, burst = await batch(options.tasks)
    return result_of(system, options.tasks, start, burst, free)


# ---------------------------------------------------------------------------------------------------
# fauxmad


SUBMIT_CHUNK = 1000  # jobs per submit in a burst


async def _fauxmad(url: str, options: JobsBenchOptions) -> SystemResult:
    client = await JobsClient.connect(url, "fauxmad-bench-jobs")
    app = "benchjobs"

    async def batch(count: int) -> tuple[float, list[Timing]]:
        sizes = [min(SUBMIT_CHUNK, count - start) for start in range(0, count, SUBMIT_CHUNK)]
        requests = [
            JobSubmitRequest(app=app, cmd=list(options.cmd), count=size, runner=options.runner)  # type: ignore[arg-type]
            for size in sizes
        ]
        submitted = time.time()
        # in submits whose answers fit in one NATS message each (the desk refuses a bigger one), all at once
        chunks = await asyncio.gather(*(client.submit(REGION, request) for request in requests))
        jobs = [job for chunk in chunks for job in chunk]
        done = await client.wait(app, [job.id for job in jobs], options.timeout, submitted=True)
        return submitted, [
            Timing(submitted, j.claimed_at or 0.0, j.started_at or 0.0, j.finished_at or 0.0) for j in done.values()
        ]

    try:
        durability = "" if options.nats_sync else ", NATS default sync"
        return await measured(f"fauxmad ({options.runner}{durability})", batch, options)
    finally:
        await client.close()


def measure_fauxmad(options: JobsBenchOptions, progress: Callable[[str], None]) -> SystemResult:
    spec = FleetSpec(
        regions=[REGION],
        workers_per_region=options.workers,
        cpus=options.slots,
        brokers=1,
        nats_sync=options.nats_sync,
    )
    with DevFleet(spec, progress=progress) as fleet:
        progress(f"fauxmad: {options.samples} tasks one at a time, then {options.tasks} at once")
        return uvloop.run(_fauxmad(fleet.url, options))


# ---------------------------------------------------------------------------------------------------
# the baselines


def missing_baselines() -> str | None:
    """Why the baselines cannot run here (one line), or None."""
    if shutil.which("redis-server") is None:
        return "redis-server not found (Debian: apt-get install redis-server): baselines skipped"
    for module in ("redis", "arq"):
        if importlib.util.find_spec(module) is None:
            return f"the Python package {module} is missing ({INSTALL_HINT}): baselines skipped"
    return None


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="fauxmad-bench-redis-")
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                import socket

                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def peer_workers(kind: str, url: str, options: JobsBenchOptions) -> Iterator[None]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "lab.bench.jobs_peers", kind, url, str(options.slots)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for _ in range(options.workers)
    ]
    try:
        time.sleep(1.5)  # imported and listening
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _redis(url: str, options: JobsBenchOptions) -> SystemResult:
    import redis.asyncio as aioredis

    from lab.bench.jobs_peers import DONE, QUEUE

    client: Any = aioredis.from_url(url)  # type: ignore[no-untyped-call]
    counter = iter(range(10**9))

    async def batch(count: int) -> tuple[float, list[Timing]]:
        submitted = time.time()
        jobs = [json.dumps({"id": next(counter), "cmd": list(options.cmd)}) for _ in range(count)]
        await client.rpush(QUEUE, *jobs)
        timings = []
        for _ in range(count):
            _, raw = await client.blpop([DONE], timeout=options.timeout)
            record = json.loads(raw)
            timings.append(Timing(submitted, record["claimed"], record["started"], record["finished"]))
        return submitted, timings

    try:
        return await measured("redis BLPOP", batch, options)
    finally:
        await client.aclose()


async def _jetstream(url: str, options: JobsBenchOptions) -> SystemResult:
    from lab.bench.jobs_peers import JetStreamQueue

    counter = iter(range(10**9))
    async with JetStreamQueue(url) as queue:

        async def batch(count: int) -> tuple[float, list[Timing]]:
            submitted = time.time()
            jobs = [{"id": next(counter), "cmd": list(options.cmd)} for _ in range(count)]
            records = await queue.batch(jobs, options.timeout)
            return submitted, [Timing(submitted, r["claimed"], r["started"], r["finished"]) for r in records]

        durability = "" if options.nats_sync else ", NATS default sync"
        return await measured(f"JetStream queue (plain nats-py{durability})", batch, options)


def measure_jetstream(options: JobsBenchOptions, progress: Callable[[str], None]) -> SystemResult:
    """The plainest queue on JetStream, on a nats-server made as fauxmad's dev fleet makes its own."""
    from lab.bench.jobs_peers import JetStreamQueue

    with EmbeddedNats(name="fauxmad-bench-queue", sync_always=options.nats_sync) as server:
        progress("a JetStream queue in plain nats-py: the same work")
        uvloop.run(JetStreamQueue.prepare(server.url))
        with peer_workers("jetstream", server.url, options):
            return uvloop.run(_jetstream(server.url, options))


async def _arq(url: str, options: JobsBenchOptions) -> SystemResult:
    from arq import create_pool
    from arq.connections import RedisSettings

    pool = await create_pool(RedisSettings.from_dsn(url))

    async def batch(count: int) -> tuple[float, list[Timing]]:
        submitted = time.time()
        jobs = await asyncio.gather(*(pool.enqueue_job("arq_run", list(options.cmd)) for _ in range(count)))
        results = await asyncio.gather(
            *(job.result(timeout=options.timeout, poll_delay=0.002 if count == 1 else 0.2) for job in jobs if job)
        )
        return submitted, [Timing(submitted, r["claimed"], r["started"], r["finished"]) for r in results]

    try:
        return await measured("arq", batch, options)
    finally:
        await pool.aclose()


def measure_baselines(options: JobsBenchOptions, progress: Callable[[str], None]) -> list[SystemResult]:
    results = []
    with redis_server() as url:
        progress("redis BLPOP: the same work")
        with peer_workers("redis", url, options):
            results.append(uvloop.run(_redis(url, options)))
    with redis_server() as url:
        progress("arq: the same work")
        with peer_workers("arq", url, options):
            results.append(uvloop.run(_arq(url, options)))
    return results


def run_jobs_bench(options: JobsBenchOptions, progress: Callable[[str], None]) -> JobsBenchResult:
    systems = [measure_fauxmad(options, progress)]
    if options.baselines:
        systems.append(measure_jetstream(options, progress))  # needs only nats-server, as fauxmad does
    skipped = []
    why = missing_baselines() if options.baselines else "baselines not asked for (--no-baselines)"
    if why is None:
        systems += measure_baselines(options, progress)
    else:
        skipped.append(why)
    return JobsBenchResult(options=options, systems=systems, skipped=skipped, host=host_info())


def jobs_report(result: JobsBenchResult) -> Report:
    o = result.options
    throughput = Table(
        title=f"throughput: {o.tasks} tasks `{' '.join(o.cmd)}` at once, {o.workers} workers x {o.slots} slots",
        columns=("system", "tasks", "seconds", "tasks/s"),
        align="lrrr",
        rows=tuple((s.system, str(s.tasks), f"{s.seconds:.2f}", f"{s.tasks_per_s:.0f}") for s in result.systems),
    )
    free = latency_table(
        f"scheduling delay with free capacity ({o.samples} tasks, one at a time)",
        [(f"{s.system}: submit -> taken", s.free_taken) for s in result.systems]
        + [(f"{s.system}: submit -> running", s.free_running) for s in result.systems],
    )
    burst = latency_table("submit -> taken in the burst (waiting for a slot included)",
                          [(s.system, s.burst_taken) for s in result.systems])  # fmt: skip
    notes = (*result.skipped, "targets: >= 500 tasks/s; p99 submit -> running <= 10 ms with free capacity")
    return Report(tables=(throughput, free, burst), notes=notes)
