"""`fauxmad bench jobs --against REV`: this tree's background jobs beside another git revision's, in one run.

A change under the jobs path (the desk, the queue, the worker's runner, the bus beneath them) is judged
against the code it replaces on the same machine and noise. REV is built once into a virtualenv of its own,
as `bench placement --against` builds it (`lab/bench/against.py`: kept in the same cache); then rounds
alternate between this tree's `fauxmad bench jobs --json --no-baselines` and REV's, the order swapped every
round, each run with a fleet of its own. Each side's figure is the median of its rounds (every round is
kept, so the spread shows), and the ratios are this tree's over REV's.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from lab.bench import BenchError
from lab.bench import against as versus
from lab.bench.jobs import JobsBenchOptions
from lab.bench.report import Report, Table, host_info, times
from lab.bench.stats import ratio

Progress = Callable[[str], None]


class JobsFigures(msgspec.Struct, kw_only=True):
    """What one `fauxmad bench jobs --json` run reported for fauxmad."""

    tasks_per_s: float
    free_running_p50_ms: float  # submit -> its process running, capacity free
    free_running_p99_ms: float
    burst_taken_p50_ms: float  # submit -> taken in the burst


class JobsSide(msgspec.Struct, kw_only=True):
    """One side: the median of its rounds (figure by figure), and each round."""

    median: JobsFigures
    runs: list[JobsFigures]


class JobsRatios(msgspec.Struct, kw_only=True):
    """This tree's figures over REV's (None where REV's is 0)."""

    throughput: float | None  # above 1: faster
    free_running_p50: float | None  # below 1: sooner
    free_running_p99: float | None

    @classmethod
    def of(cls, mine: JobsFigures, theirs: JobsFigures) -> JobsRatios:
        return cls(
            throughput=ratio(mine.tasks_per_s, theirs.tasks_per_s),
            free_running_p50=ratio(mine.free_running_p50_ms, theirs.free_running_p50_ms),
            free_running_p99=ratio(mine.free_running_p99_ms, theirs.free_running_p99_ms),
        )


class JobsAgainstResult(versus.Compared, kw_only=True):
    options: JobsBenchOptions
    this: JobsSide
    other: JobsSide
    ratios: JobsRatios


def bench_args(o: JobsBenchOptions, output: Path) -> list[str]:
    """`bench jobs` options that ddae660's code already understood; never the baselines (only fauxmad compares)."""
    args = ["bench", "jobs", "--json", "--no-baselines", "--output", str(output)]
    args += ["--tasks", str(o.tasks), "--samples", str(o.samples), "--workers", str(o.workers)]
    args += ["--slots", str(o.slots), "--runner", o.runner]
    return [*args, "--nats-sync" if o.nats_sync else "--no-nats-sync"]


def figures(data: Any, who: str) -> JobsFigures:
    try:
        ours = data["systems"][0]
        return JobsFigures(
            tasks_per_s=float(ours["tasks_per_s"]),
            free_running_p50_ms=float(ours["free_running"]["p50_ms"]),
            free_running_p99_ms=float(ours["free_running"]["p99_ms"]),
            burst_taken_p50_ms=float(ours["burst_taken"]["p50_ms"]),
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise BenchError(f"{who}'s bench wrote no jobs result ({exc!r})") from None


def side(runs: list[JobsFigures]) -> JobsSide:
    medians = {name: statistics.median(getattr(r, name) for r in runs) for name in JobsFigures.__struct_fields__}
    rounded = {name: round(value, 1 if name == "tasks_per_s" else 3) for name, value in medians.items()}
    return JobsSide(median=JobsFigures(**rounded), runs=runs)


def run_jobs_against(
    options: JobsBenchOptions, rev: str, rounds: int = 4, progress: Progress = lambda line: None
) -> JobsAgainstResult:
    sha = versus.resolve(rev)
    theirs_cmd = [str(versus.build(rev, sha, versus.default_cache(), progress))]
    ours_cmd = [sys.executable, "-m", "orchestrator.cli"]
    ours: list[JobsFigures] = []
    other: list[JobsFigures] = []
    with tempfile.TemporaryDirectory(prefix="fauxmad-jobs-against-") as tmp:
        output = Path(tmp) / "result.json"
        sides = [("this tree", ours_cmd, versus.ROOT, ours), (rev, theirs_cmd, Path(tmp), other)]
        for n in range(rounds):
            for who, command, cwd, into in sides if n % 2 == 0 else sides[::-1]:
                progress(
                    f"round {n + 1} of {rounds}: {who}, {options.samples} tasks one at a time, {options.tasks} at once"
                )
                began = time.monotonic()
                data, _ = versus.run_json([*command, *bench_args(options, output)], cwd, who)
                into.append(figures(data, who))
                progress(f"  {into[-1].tasks_per_s:.0f} tasks/s ({time.monotonic() - began:.0f} s with its fleet)")
    this, them = side(ours), side(other)
    ratios = JobsRatios.of(this.median, them.median)
    return JobsAgainstResult(
        options=options, rev=rev, rev_commit=sha, this_commit=versus.this_commit(), rounds=rounds, this=this,
        other=them, ratios=ratios, host=host_info(),
    )  # fmt: skip


def report(result: JobsAgainstResult) -> Report:
    def row(name: str, s: JobsSide) -> tuple[str, ...]:
        m = s.median
        return (
            name,
            f"{m.tasks_per_s:.0f}",
            ", ".join(f"{r.tasks_per_s:.0f}" for r in s.runs),
            f"{m.free_running_p50_ms:.2f}",
            f"{m.free_running_p99_ms:.2f}",
            f"{m.burst_taken_p50_ms:.1f}",
        )

    o = result.options
    table = Table(
        title=f"jobs: this tree beside {result.rev} ({result.rev_commit[:12]}), {result.rounds} rounds alternating"
        f" ({o.tasks} tasks at once, {o.samples} one at a time, {o.workers} workers x {o.slots} slots)",
        columns=("side", "tasks/s", "tasks/s of rounds", "running p50 ms", "running p99 ms", "burst taken p50 ms"),
        align="lrlrrr",
        rows=(row("this tree", result.this), row(result.rev, result.other)),
    )
    notes = (
        f"this tree / {result.rev}: throughput {times(result.ratios.throughput)}, submit -> running p50"
        f" {times(result.ratios.free_running_p50)}, p99 {times(result.ratios.free_running_p99)}",
        f"this tree {result.this_commit[:12]}, {result.rev} {result.rev_commit[:12]}; each figure the median of its"
        " rounds (free capacity: submit -> its process running)",
    )
    return Report(tables=(table,), notes=notes)
