"""The one bridge from the CLI into `workers` for benchmarks: hand the worker's store measurements
(`lab.bench.worker_store`) to the worker benchmark (`lab.bench.worker`), which knows them only as a
`StoreBench` Protocol. Nothing else belongs here."""

from __future__ import annotations

from collections.abc import Callable

from lab.bench import worker_store as store_bench
from lab.bench.worker import WorkerBenchResult, run_worker_bench


def run(*, reserves: int, sizes: list[int], progress: Callable[[str], None]) -> WorkerBenchResult:
    return run_worker_bench(store_bench, reserves=reserves, sizes=sizes, progress=progress)
