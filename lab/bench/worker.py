"""One worker, measured: reserve latency over NATS, commits/s with fsync, restart time, resident memory.

The parts over the bus are here: a real worker process (started as on a host, `python -m
orchestrator.cli worker`), reserves sent to it one at a time, its RSS at rest, and how long a worker
takes from process start to answering when its log holds 100k or 1M records. The parts inside the
worker's store (commit rates, building a big log, opening it) come through `StoreBench`, which
`lab.bench.worker_store` implements; the CLI passes it in, so the orchestrator never imports `workers`.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from bus.contract import subjects
from bus.contract.machines import MachineConfig, ReserveRequest
from bus.local.embedded import EmbeddedNats
from bus.transport.connection import connect
from bus.transport.service import request
from lab.bench import BenchError
from lab.bench.report import Report, Table, latency_table
from lab.bench.stats import Latency, summarize

ROOT = Path(__file__).resolve().parent.parent.parent
REGION = "bench"


class StoreBench(Protocol):
    """The worker store's own measurements (`lab.bench.worker_store`)."""

    def commit_rates(self, root: Path) -> tuple[float, float, float]: ...

    def build_log(self, path: Path, records: int) -> float: ...

    def open_and_scan(self, path: Path) -> int: ...


class RestartResult(msgspec.Struct, kw_only=True):
    log_records: int
    machines: int
    log_mb: float
    open_ms: float
    ready_ms: float


class WorkerBenchResult(msgspec.Struct, kw_only=True):
    reserve: Latency
    commits_per_s_serial: float
    commits_per_s_concurrent: float
    commits_per_batch: float
    rss_mb_at_rest: float
    restart: list[RestartResult]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not ended within 10 s (the bench's and the tests' processes alike)."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _spawn_worker(url: str, data_dir: Path, worker_id: str) -> subprocess.Popen[bytes]:
    args = ["--nats", url, "--region", REGION, "--worker-id", worker_id, "--data-dir", str(data_dir)]
    args += ["--cpus", "1000000", "--memory-mb", "1000000000"]
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "worker", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=str(ROOT),
    )


async def _wait_ready(url: str, worker_id: str, timeout: float = 120.0) -> None:
    nc = await connect(url, "fauxmad-bench")
    try:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            try:
                await nc.request(subjects.worker_info(worker_id), b"", timeout=0.2)
                return
            except Exception:
                await asyncio.sleep(0.005)
        raise BenchError(f"worker {worker_id} not ready within {timeout:g}s")
    finally:
        await nc.close()


async def _reserve_latency(url: str, worker_id: str, count: int) -> Latency:
    nc = await connect(url, "fauxmad-bench")
    reserve = ReserveRequest(app="bench", region=REGION, config=MachineConfig(cmd=["true"]))
    subject = subjects.worker_machines(worker_id, "reserve")
    samples = []
    try:
        for _ in range(count):
            began = time.perf_counter()
            await request(nc, subject, reserve, timeout=5)
            samples.append(time.perf_counter() - began)
    finally:
        await nc.close()
    return summarize(samples)


def _restart(store: StoreBench, url: str, root: Path, records: int, progress: Callable[[str], None]) -> RestartResult:
    data_dir = root / f"restart-{records}"
    progress(f"writing a log of {records} records")
    log_mb = store.build_log(data_dir / "lmdb", records)
    began = time.perf_counter()
    machines = store.open_and_scan(data_dir / "lmdb")
    open_ms = (time.perf_counter() - began) * 1000
    began = time.perf_counter()
    proc = _spawn_worker(url, data_dir, "restart")
    try:
        asyncio.run(_wait_ready(url, "restart"))
        ready_ms = (time.perf_counter() - began) * 1000
    finally:
        stop_process(proc)
    return RestartResult(
        log_records=records,
        machines=machines,
        log_mb=round(log_mb, 1),
        open_ms=round(open_ms, 2),
        ready_ms=round(ready_ms, 1),
    )


def run_worker_bench(
    store: StoreBench, *, reserves: int, sizes: list[int], progress: Callable[[str], None] = lambda line: None
) -> WorkerBenchResult:
    root = Path(tempfile.mkdtemp(prefix="fauxmad-bench-"))
    server = EmbeddedNats(store_dir=root / "nats").start()
    try:
        proc = _spawn_worker(server.url, root / "w", "bench-w")
        try:
            asyncio.run(_wait_ready(server.url, "bench-w"))
            time.sleep(2.0)  # at rest: past start-up and its first heartbeats
            rss = rss_mb(proc.pid)
            progress(f"{reserves} sequential reserves over NATS")
            reserve = asyncio.run(_reserve_latency(server.url, "bench-w", reserves))
        finally:
            stop_process(proc)
        progress("commits per second with fsync")
        serial_rate, concurrent_rate, per_batch = store.commit_rates(root)
        restarts = [_restart(store, server.url, root, n, progress) for n in sizes]
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return WorkerBenchResult(
        reserve=reserve,
        commits_per_s_serial=round(serial_rate, 1),
        commits_per_s_concurrent=round(concurrent_rate, 1),
        commits_per_batch=round(per_batch, 2),
        rss_mb_at_rest=round(rss, 1),
        restart=restarts,
    )


def report(result: WorkerBenchResult) -> Report:
    restarts = Table(
        title="restart vs log size",
        columns=("log records", "machines", "log MB", "open+scan ms", "start to ready ms"),
        align="rrrrr",
        rows=tuple(
            (str(r.log_records), str(r.machines), f"{r.log_mb:.0f}", f"{r.open_ms:.1f}", f"{r.ready_ms:.0f}")
            for r in result.restart
        ),
    )
    notes = (
        f"commits/s with fsync: {result.commits_per_s_concurrent:.0f} with 64 concurrent writers "
        f"({result.commits_per_batch:.1f} per fsync), {result.commits_per_s_serial:.0f} one at a time",
        f"worker RSS at rest: {result.rss_mb_at_rest:.1f} MB",
    )
    tables = (latency_table("worker", [("reserve over NATS", result.reserve)]),)
    return Report(tables=tables + ((restarts,) if result.restart else ()), notes=notes)
