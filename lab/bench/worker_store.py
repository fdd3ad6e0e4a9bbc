"""The worker's store, measured: what `fauxmad bench worker` needs from inside the worker.

Lives beside the store it measures so the orchestrator never imports `workers`: the CLI's edge
(`lab.cli.worker_bench`) hands this module to `lab.bench.worker.run_worker_bench`
as its `StoreBench`. Three measurements, all on a real LMDB environment with fsync:

- `commit_rates`: commits per second one at a time, and under 64 concurrent writers through the
  `GroupCommitter` (with how many commits share each fsync);
- `build_log`: a store whose log holds N records over 1000 machines (none running), for restart times;
- `open_and_scan`: open a store and read what a starting worker reads (its machines and usage).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from bus.contract.machines import Machine, MachineConfig
from workers.log.commit import GroupCommitter
from workers.log.records import StoredMachine
from workers.log.store import Store, Tx


def _machine(i: int, *, worker_id: str, cmd: list[str]) -> StoredMachine:
    return StoredMachine(
        machine=Machine(
            id=f"{i:014x}",
            name=f"m{i}",
            app="bench",
            region="bench",
            worker_id=worker_id,
            state="created",
            config=MachineConfig(cmd=cmd),
            instance_id="i",
            created_at="t",
            updated_at="t",
        )
    )


def commit_rates(
    root: Path, *, serial: int = 2000, concurrent: int = 20_000, writers: int = 64
) -> tuple[float, float, float]:
    """(commits/s one at a time, commits/s with `writers` concurrent writers, commits per fsync then)."""
    store = Store(root / "commits")
    committer = GroupCommitter(store)

    def reserve_op(i: int) -> Callable[[Tx], StoredMachine]:
        return lambda tx: tx.put_machine(_machine(i, worker_id="w", cmd=["true"]), "reserve")

    async def one_at_a_time(n: int) -> float:
        began = time.perf_counter()
        for i in range(n):
            await committer.submit(reserve_op(i))
        return n / (time.perf_counter() - began)

    async def together(n: int) -> tuple[float, float]:
        batches_before, ops_before = committer.batches, committer.ops
        todo = iter(range(1_000_000, 1_000_000 + n))

        async def writer() -> None:
            for i in todo:
                await committer.submit(reserve_op(i))

        began = time.perf_counter()
        await asyncio.gather(*[writer() for _ in range(writers)])
        rate = n / (time.perf_counter() - began)
        per_batch = (committer.ops - ops_before) / max(1, committer.batches - batches_before)
        return rate, per_batch

    try:
        serial_rate = asyncio.run(one_at_a_time(serial))
        concurrent_rate, per_batch = asyncio.run(together(concurrent))
    finally:
        committer.close()
        store.close()
    return serial_rate, concurrent_rate, per_batch


def build_log(path: Path, records: int, machines: int = 1000) -> float:
    """A store at `path` whose log holds `records` records over `machines` machines (none left running);
    returns its size in MB."""
    store = Store(path, sync=False)
    batch = 20_000
    try:
        for start in range(0, records, batch):

            def op(tx: Tx, start: int = start) -> None:
                for n in range(start, min(records, start + batch)):
                    i = n % machines
                    stored = tx.get(f"{i:014x}") or _machine(i, worker_id="restart", cmd=["sleep", "1"])
                    if n >= machines:  # every later record a stop: the log grows, nothing is left running
                        stored.machine.state = "stopped"
                    tx.put_machine(stored, "bench")

            store.write(op)
        store.env.sync(True)
    finally:
        store.close()
    return sum(f.stat().st_size for f in path.iterdir()) / 1e6


def open_and_scan(path: Path) -> int:
    """Open the store at `path` and read what a starting worker reads; returns how many machines it holds."""
    store = Store(path)
    try:
        count = len(store.machines())
        store.usage()
    finally:
        store.close()
    return count
