"""The worker benchmark behind `fauxmad bench worker` (the CLI's permitted edge into `workers`).

Measures what the worker issue asks for: reserve latency over NATS against a real worker process,
commits per second with fsync (one at a time, and group-committed under 64 concurrent writers),
restart time for logs of 100k and 1M records (store open and scan, and process start to ready),
and the worker's resident memory at rest.
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

import msgspec
import nats

from bus.embedded import EmbeddedNats
from orchestrator.benchstats import Latency, summarize

ROOT = Path(__file__).resolve().parent.parent.parent


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


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _spawn_worker(url: str, data_dir: Path, worker_id: str) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "worker",
        "--nats",
        url,
        "--region",
        "bench",
        "--worker-id",
        worker_id,
        "--cpus",
        "1000000",
        "--memory-mb",
        "1000000000",
        "--data-dir",
        str(data_dir),
    ]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=str(ROOT))


async def _wait_ready(url: str, worker_id: str, timeout: float = 120.0) -> None:
    nc = await nats.connect(url)
    try:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            try:
                await nc.request(f"fauxmad.v1.worker.{worker_id}.info", b"", timeout=0.2)
                return
            except Exception:
                await asyncio.sleep(0.005)
        raise TimeoutError(f"worker {worker_id} not ready within {timeout}s")
    finally:
        await nc.close()


async def _reserve_latency(url: str, worker_id: str, count: int) -> Latency:
    nc = await nats.connect(url)
    payload = msgspec.json.encode({"app": "bench", "region": "bench", "config": {"cmd": ["true"]}})
    subject = f"fauxmad.v1.worker.{worker_id}.machines.reserve"
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        msg = await nc.request(subject, payload, timeout=5)
        samples.append(time.perf_counter() - began)
        assert not msg.headers, msg.data
    await nc.close()
    return summarize(samples)


def _commit_rates(root: Path) -> tuple[float, float, float]:
    from bus.messages import Machine, MachineConfig
    from workers.records import StoredMachine
    from workers.store import GroupCommitter, Store, Tx

    store = Store(root / "commits")
    committer = GroupCommitter(store)

    def machine(i: int) -> StoredMachine:
        return StoredMachine(
            machine=Machine(
                id=f"{i:014x}",
                name="m",
                app="bench",
                region="bench",
                worker_id="w",
                state="created",
                config=MachineConfig(cmd=["true"]),
                instance_id="i",
                created_at="t",
                updated_at="t",
            )
        )

    def reserve_op(i: int) -> Callable[[Tx], StoredMachine]:
        return lambda tx: tx.put_machine(machine(i), "reserve")

    async def serial(n: int) -> float:
        began = time.perf_counter()
        for i in range(n):
            await committer.submit(reserve_op(i))
        return n / (time.perf_counter() - began)

    async def concurrent(n: int, writers: int) -> tuple[float, float]:
        batches_before, ops_before = committer.batches, committer.ops
        queue = list(range(1_000_000, 1_000_000 + n))

        async def writer() -> None:
            while queue:
                i = queue.pop()
                await committer.submit(reserve_op(i))

        began = time.perf_counter()
        await asyncio.gather(*[writer() for _ in range(writers)])
        rate = n / (time.perf_counter() - began)
        per_batch = (committer.ops - ops_before) / max(1, committer.batches - batches_before)
        return rate, per_batch

    serial_rate = asyncio.run(serial(2000))
    concurrent_rate, per_batch = asyncio.run(concurrent(20000, 64))
    committer.close()
    store.close()
    return serial_rate, concurrent_rate, per_batch


def build_log(path: Path, records: int, machines: int = 1000) -> float:
    """A worker store whose log holds `records` records over `machines` machines (none running)."""
    from bus.messages import Machine, MachineConfig
    from workers.records import StoredMachine
    from workers.store import Store

    store = Store(path, sync=False)
    cycle = ["starting", "started", "stopping", "stopped"]
    written = 0
    batch = 20_000
    while written < records:

        def op(tx, start: int = written) -> None:  # type: ignore[no-untyped-def]
            for n in range(start, min(records, start + batch)):
                i = n % machines
                stored = tx.get(f"{i:014x}") or StoredMachine(
                    machine=Machine(
                        id=f"{i:014x}",
                        name=f"m{i}",
                        app="bench",
                        region="bench",
                        worker_id="restart",
                        state="created",
                        config=MachineConfig(cmd=["sleep", "1"]),
                        instance_id="i",
                        created_at="t",
                        updated_at="t",
                    )
                )
                if n >= machines:
                    stored.machine.state = cycle[(n // machines) % 4]  # type: ignore[assignment]
                    if stored.machine.state in ("starting", "started", "stopping"):
                        stored.machine.state = "stopped"
                tx.put_machine(stored, "bench")

        store.write(op)
        written = min(records, written + batch)
    store.env.sync(True)
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    store.close()
    return size


def _restart(url: str, root: Path, records: int, progress: Callable[[str], None]) -> RestartResult:
    from workers.store import Store

    data_dir = root / f"restart-{records}"
    progress(f"writing a log of {records} records")
    log_mb = build_log(data_dir / "lmdb", records)
    began = time.perf_counter()
    store = Store(data_dir / "lmdb")
    machines = len(store.machines())
    store.usage()
    open_ms = (time.perf_counter() - began) * 1000
    store.close()
    began = time.perf_counter()
    proc = _spawn_worker(url, data_dir, "restart")
    try:
        asyncio.run(_wait_ready(url, "restart"))
        ready_ms = (time.perf_counter() - began) * 1000
    finally:
        _stop(proc)
    return RestartResult(
        log_records=records,
        machines=machines,
        log_mb=round(log_mb, 1),
        open_ms=round(open_ms, 2),
        ready_ms=round(ready_ms, 1),
    )


def run_worker_bench(*, reserves: int, sizes: list[int], progress: Callable[[str], None]) -> WorkerBenchResult:
    root = Path(tempfile.mkdtemp(prefix="fauxmad-bench-"))
    server = EmbeddedNats(store_dir=root / "nats").start()
    try:
        proc = _spawn_worker(server.url, root / "w", "bench-w")
        try:
            asyncio.run(_wait_ready(server.url, "bench-w"))
            time.sleep(2.0)
            rss = _rss_mb(proc.pid)
            progress(f"{reserves} sequential reserves over NATS")
            reserve = asyncio.run(_reserve_latency(server.url, "bench-w", reserves))
        finally:
            _stop(proc)
        progress("commits per second with fsync")
        serial_rate, concurrent_rate, per_batch = _commit_rates(root)
        restarts = [_restart(server.url, root, n, progress) for n in sizes]
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
