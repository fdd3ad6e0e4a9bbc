"""`fauxmad bench placement --against-workers N`: two fleet sizes in one run, rounds alternating.

Why: the p2c target (issue 44) is a ratio, the p99 at 1,000 workers over the p99 at 10, and on a shared
host two runs minutes apart move by several ms each, more than the difference sought. So both sizes are
measured in one run, in rounds that alternate (A B, B A, A B, ...: the drift of the machine hits both).

Each round starts a fleet of its own, warms it up, measures its share of the creates, and stops it:
with both fleets up at once, the large fleet's background (its heartbeats, its timers) would also weigh on
the small fleet's rounds and hide what is measured. Each size's samples are pooled over its rounds
(a p99 of every sample, not a median of the rounds' p99s, which at a few hundred creates a round would be
the third worst of each); each round's own p50 and p99 are kept beside them, the spread to judge a ratio by.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import uvloop

from lab.bench import BenchError
from lab.bench.floor_run import split
from lab.bench.placement import CreateRun, PlacementOptions, fleet_spec, measure_creates
from lab.bench.report import Report, Table, host_info, latency_row, times
from lab.bench.stats import Latency, ratio, summarize
from orchestrator.devfleet import DevFleet

Progress = Callable[[str], None]


class SizesOptions(msgspec.Struct, frozen=True, kw_only=True):
    placement: PlacementOptions  # its `workers` is the first size; `count` is each size's, split over the rounds
    against_workers: int  # the other size, workers per region
    rounds: int = 4  # per size


class SizeRound(msgspec.Struct, kw_only=True):
    """One round of one size: its own fleet's creates."""

    p50_ms: float
    p99_ms: float
    throughput_per_s: float
    fleet_start_s: float


class SizeSide(msgspec.Struct, kw_only=True):
    """One size, every round's samples pooled."""

    workers_per_region: int
    workers_per_process: int
    create: Latency
    throughput_per_s: float
    refused: int
    errors: int
    rounds: list[SizeRound]
    first_error: str | None = None


class SizesResult(msgspec.Struct, kw_only=True):
    strategy: str
    regions: int
    concurrency: int
    start: bool
    rounds: int
    count_per_side: int
    this: SizeSide  # --workers
    other: SizeSide  # --against-workers
    p50_ratio: float | None  # this size's / the other's
    p99_ratio: float | None
    throughput_ratio: float | None
    host: dict[str, object]


class _Tally:
    def __init__(self, options: PlacementOptions) -> None:
        self.options = options
        self.samples: list[float] = []
        self.wall = 0.0
        self.refused = 0
        self.errors = 0
        self.first_error: str | None = None
        self.rounds: list[SizeRound] = []

    def side(self) -> SizeSide:
        done = len(self.samples)
        return SizeSide(
            workers_per_region=self.options.workers,
            workers_per_process=fleet_spec(self.options).workers_per_process,
            create=summarize(self.samples),
            throughput_per_s=round(done / self.wall, 1) if self.wall > 0 else 0.0,
            refused=self.refused,
            errors=self.errors,
            rounds=self.rounds,
            first_error=self.first_error,
        )


def _round(options: PlacementOptions, count: int, tally: _Tally, progress: Progress) -> None:
    """Start a fleet of this size, warm it up, measure `count` creates into the tally, stop the fleet."""
    p = options
    began = time.monotonic()
    fleet = DevFleet(fleet_spec(p)).start(timeout=300)
    started = time.monotonic() - began
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:

            def creates(n: int) -> CreateRun:
                return loop.run(
                    measure_creates(
                        fleet.url,
                        p.region_names,
                        count=n,
                        concurrency=p.concurrency,
                        strategy=p.strategy,
                        start=p.start,
                    )
                )

            if p.warmup:
                creates(p.warmup)
            run = creates(count)
    finally:
        fleet.stop()
    tally.samples += run.samples
    tally.wall += run.wall_s
    tally.refused += run.refused
    tally.errors += run.errors
    tally.first_error = tally.first_error or run.first_error or run.first_refusal
    own = summarize(run.samples)
    tally.rounds.append(
        SizeRound(
            p50_ms=own.p50_ms,
            p99_ms=own.p99_ms,
            throughput_per_s=round(len(run.samples) / run.wall_s, 1) if run.wall_s > 0 else 0.0,
            fleet_start_s=round(started, 1),
        )
    )
    progress(f"  p50 {own.p50_ms:.2f} ms, p99 {own.p99_ms:.2f} ms (its fleet started in {started:.0f} s)")


def run_sizes(options: SizesOptions, progress: Progress = lambda line: None) -> SizesResult:
    p = options.placement
    if p.nats is not None or p.supercluster:
        raise BenchError("--against-workers starts fleets of its own: leave out --nats and --supercluster")
    if options.against_workers == p.workers:
        raise BenchError(f"--against-workers {options.against_workers} is --workers' size: give another size")
    ours = _Tally(p)
    theirs = _Tally(msgspec.structs.replace(p, workers=options.against_workers))
    counts = split(p.count, options.rounds)
    for n, count in enumerate(counts):
        order = (ours, theirs) if n % 2 == 0 else (theirs, ours)
        for tally in order:
            size = tally.options.workers * p.regions
            progress(f"round {n + 1} of {len(counts)}: {size} workers, {count} creates (a fleet of its own)")
            _round(tally.options, count, tally, progress)
    a, b = ours.side(), theirs.side()
    return SizesResult(
        strategy=p.strategy,
        regions=p.regions,
        concurrency=p.concurrency,
        start=p.start,
        rounds=len(counts),
        count_per_side=p.count,
        this=a,
        other=b,
        p50_ratio=ratio(a.create.p50_ms, b.create.p50_ms),
        p99_ratio=ratio(a.create.p99_ms, b.create.p99_ms),
        throughput_ratio=ratio(a.throughput_per_s, b.throughput_per_s),
        host=host_info(),
    )


def _name(s: SizeSide, regions: int) -> str:
    where = f" x {regions} regions" if regions > 1 else ""
    per = f", {s.workers_per_process} a process" if s.workers_per_process > 1 else ""
    return f"{s.workers_per_region:,} workers{where}{per}"


def report(result: SizesResult) -> Report:
    columns = ("fleet", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "creates/s", "rounds' p50 / p99 ms")
    rows = []
    notes = []
    for s in (result.this, result.other):
        spread = ", ".join(f"{r.p50_ms:.2f}/{r.p99_ms:.2f}" for r in s.rounds)
        rows.append((*latency_row(_name(s, result.regions), s.create), f"{s.throughput_per_s:.0f}", spread))
        if s.errors or s.refused:
            notes.append(f"{s.workers_per_region} workers: {s.refused} refused, {s.errors} errors: {s.first_error}")
    a, b = result.this.workers_per_region, result.other.workers_per_region
    notes.insert(
        0,
        f"{a:,} workers / {b:,} workers: p99 {times(result.p99_ratio)}, p50 {times(result.p50_ratio)},"
        f" throughput {times(result.throughput_ratio)}",
    )
    what = "create+start" if result.start else "create (reserve)"
    title = (
        f"{what} at two fleet sizes: {result.strategy}, concurrency {result.concurrency}, {result.rounds} alternating"
        f" rounds of {result.count_per_side // result.rounds} creates each side (each round a fleet of its own;"
        " samples pooled)"
    )
    table = Table(title=title, columns=columns, align="lrrrrrrl", rows=tuple(rows))
    return Report(tables=(table,), notes=tuple(notes))
