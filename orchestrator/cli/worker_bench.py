"""The one bridge from the CLI into `workers` for benchmarks: hand the worker's store measurements
(`workers.bench`) to the worker benchmark (`orchestrator.bench.worker`), which knows them only as a
`StoreBench` Protocol. Nothing else belongs here."""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.bench.worker import WorkerBenchResult, run_worker_bench
from workers import bench as store_bench


def run(*, reserves: int, sizes: list[int], progress: Callable[[str], None]) -> WorkerBenchResult:
    return run_worker_bench(store_bench, reserves=reserves, sizes=sizes, progress=progress)
