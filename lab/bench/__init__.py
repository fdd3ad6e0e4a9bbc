"""The benchmarks behind `fauxmad bench`, as a library: each measures and returns a result Struct.

No typer and no rich here (the CLI parses options, calls one `run_*` function and renders): progress
goes through a `progress(line)` callback, and each module's `report(result)` says what to show as
plain tables (`report.Report`), which the CLI draws with rich on a terminal and as aligned text
otherwise. Nothing here imports `workers`: the worker benchmark gets the worker's store measurements
through a Protocol (`worker.StoreBench`), filled by `lab.bench.worker_store` at the CLI's edge.

- `stats`: percentiles by nearest rank, in milliseconds; ratios.
- `report`: tables as data, and their plain-text rendering.
- `echo`: the bus round trip, answered by a responder in another process.
- `placement`: a fleet of N workers, creates at concurrency C (reserve only or started).
- `worker`: one worker process: reserve latency over NATS, commits/s, restart time, RSS.
- `deploy`, `failover`: the reconcilers on a real local fleet.
- `peer`: Ray on the same machine in the same run (optional extra `peers`).
"""

from __future__ import annotations


class BenchError(Exception):
    """A benchmark could not complete (the fleet did not settle, a deploy failed): one line for the user."""
