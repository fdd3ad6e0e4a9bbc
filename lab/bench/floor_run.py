"""`fauxmad bench placement --floor`: fauxmad's create beside the floor, same run, same nats-server.

One dev fleet (nats-server, workers, brokers: `placement.fleet_spec`) and, on its nats-server, the floor's
responders (`lab.bench.floor`, one per fauxmad worker). At concurrency 1 and at the asked concurrency,
each side warms up, then rounds alternate (fauxmad, floor, fauxmad, ...) so the drift of a shared
machine hits both; every round adds its samples to its side. Beside latency and throughput, the CPU of
the processes each side needs (`lab.bench.cpu`: fauxmad's nats-server, workers and brokers; the floor's
nats-server and responders) is summed over the measured creates only. The client (this process, the
same for both sides: fauxmad's `FleetClient` or the floor's nats-py client) is counted in neither; its
own CPU per create is shown apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import uvloop

from lab.bench import BenchError
from lab.bench.cpu import CpuMeter, CpuUse, SelfMeter
from lab.bench.echo import EchoResponder
from lab.bench.floor import FloorResponders, FloorRun, measure_floor_creates
from lab.bench.placement import CreateRun, PlacementOptions, fleet_spec, measure_creates
from lab.bench.report import Report, Table, host_info, latency_row, times
from lab.bench.stats import Latency, Ratio, ratio, ratios, summarize
from orchestrator.devfleet import DevFleet

Progress = Callable[[str], None]


class FloorOptions(msgspec.Struct, frozen=True, kw_only=True):
    placement: PlacementOptions
    rounds: int = 4  # per concurrency; each side's count is split over them
    data_dir: str | None = None  # keep the floor's LMDB files there (tests read them); None: a temporary dir


class Side(msgspec.Struct, kw_only=True):
    """One side (fauxmad or the floor) at one concurrency, all its rounds together."""

    create: Latency
    throughput_per_s: float
    refused: int
    errors: int
    cpu: CpuUse  # nats-server + the side's own processes, over the measured creates
    client_cpu_ms_per_create: float | None  # this process (the client), counted in neither side's cpu
    first_error: str | None = None


class FloorLevel(msgspec.Struct, kw_only=True):
    concurrency: int
    fauxmad: Side
    floor: Side
    latency_over_floor: Ratio  # fauxmad's p50 / floor's p50, p99 / p99
    throughput_over_floor: float | None
    cpu_over_floor: float | None  # fauxmad's CPU ms/create / the floor's


class FloorResult(msgspec.Struct, kw_only=True):
    workers_per_region: int
    regions: int
    strategy: str
    rounds: int
    deadline_ms: float
    levels: list[FloorLevel]
    floor_acknowledged: int  # reserves the floor's responders acknowledged (warm-up included)
    floor_stream_messages: int  # what their JetStream stream holds at the end: one per acknowledged reserve
    bus_rtt: Latency
    cpu_counts: str
    host: dict[str, object]


CPU_COUNTS = (
    "fauxmad: nats-server, worker and broker processes (and their children); floor: nats-server and the"
    " responders; the client (this process) in neither"
)


class _Tally:
    """What one side's rounds add up to at one concurrency."""

    def __init__(self, roots: list[int]) -> None:
        self.samples: list[float] = []
        self.wall = 0.0
        self.refused = 0
        self.errors = 0
        self.first_error: str | None = None
        self.cpu = CpuMeter(roots)
        self.client = SelfMeter()

    def add(self, run: CreateRun) -> None:
        self.samples += run.samples
        self.wall += run.wall_s
        self.refused += run.refused
        self.errors += run.errors
        self.first_error = self.first_error or run.first_error or run.first_refusal

    def side(self) -> Side:
        done = len(self.samples)
        return Side(
            create=summarize(self.samples),
            throughput_per_s=round(done / self.wall, 1) if self.wall > 0 else 0.0,
            refused=self.refused,
            errors=self.errors,
            cpu=self.cpu.use(done),
            client_cpu_ms_per_create=self.client.ms_per_op(done),
            first_error=self.first_error,
        )


def fleet_pids(fleet: DevFleet) -> tuple[int, list[int]]:
    """(nats-server's pid, the fleet's worker and broker processes' pids)."""
    if fleet.nats is None or fleet.nats.process is None:
        raise BenchError("--floor needs the fleet's own nats-server (one server, not a supercluster)")
    return fleet.nats.process.pid, [proc.pid for _, proc in fleet.processes]


def split(count: int, rounds: int) -> list[int]:
    """`count` creates over `rounds` rounds, as evenly as can be (no empty round)."""
    rounds = max(1, min(rounds, count))
    return [count // rounds + (1 if i < count % rounds else 0) for i in range(rounds)]


def run_floor(options: FloorOptions, progress: Progress = lambda line: None) -> FloorResult:
    p = options.placement
    if p.start or p.nats is not None or p.supercluster:
        raise BenchError(
            "--floor measures reserve only on a fleet of its own: leave out --start, --nats, --supercluster"
        )
    spec = fleet_spec(p)
    progress(f"starting {p.workers * p.regions} workers and {p.brokers} broker(s), and as many floor responders")
    fleet = DevFleet(spec).start(timeout=300)
    try:
        nats_pid, fleet_own = fleet_pids(fleet)
        root = Path(options.data_dir) if options.data_dir else None
        with (
            FloorResponders(fleet.url, p.region_names, p.workers, root=root) as floor,
            EchoResponder(fleet.url) as echo,
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop,
        ):
            levels: list[FloorLevel] = []
            acknowledged = 0
            for concurrency in dict.fromkeys([1, p.concurrency]):
                level, acked = _level(
                    loop,
                    fleet.url,
                    floor,
                    options,
                    concurrency,
                    spec.deadline_ms / 1000,
                    ([nats_pid, *fleet_own], [nats_pid, *floor.pids]),
                    progress,
                )
                levels.append(level)
                acknowledged += acked
            progress(f"{p.echo_count} bus round trips (echo in another process)")
            rtt = loop.run(echo.measure(p.echo_count))
            stream_messages = loop.run(floor.stream_messages())
    finally:
        progress("stopping the fleet")
        fleet.stop()
    return FloorResult(
        workers_per_region=p.workers,
        regions=p.regions,
        strategy=p.strategy,
        rounds=options.rounds,
        deadline_ms=spec.deadline_ms,
        levels=levels,
        floor_acknowledged=acknowledged,
        floor_stream_messages=stream_messages,
        bus_rtt=rtt,
        cpu_counts=CPU_COUNTS,
        host=host_info(),
    )


def _level(
    loop: asyncio.Runner,
    url: str,
    floor: FloorResponders,
    options: FloorOptions,
    concurrency: int,
    deadline: float,
    roots: tuple[list[int], list[int]],
    progress: Progress,
) -> tuple[FloorLevel, int]:
    """Warm-up and alternating rounds at one concurrency; also how many reserves the floor acknowledged."""
    p = options.placement
    regions = p.region_names
    ours, theirs = _Tally(roots[0]), _Tally(roots[1])
    acked = 0

    def fauxmad(count: int, tally: _Tally | None) -> None:
        meters = (tally.cpu, tally.client) if tally else ()
        run = loop.run(
            measure_creates(
                url, regions, count=count, concurrency=concurrency, strategy=p.strategy, start=False, meters=meters
            )
        )
        if tally:
            tally.add(run)

    def floor_side(count: int, tally: _Tally | None) -> None:
        nonlocal acked
        meters = (tally.cpu, tally.client) if tally else ()
        run: FloorRun = loop.run(
            measure_floor_creates(
                url, regions, floor.per_region, count=count, concurrency=concurrency, deadline=deadline, meters=meters
            )
        )
        acked += len(run.acknowledged)
        if tally:
            tally.add(run)

    if p.warmup:
        progress(f"c={concurrency}: {p.warmup} creates to warm up, each side")
        fauxmad(p.warmup, None)
        floor_side(p.warmup, None)
    rounds = split(p.count, options.rounds)
    progress(f"c={concurrency}: {p.count} creates each side, in {len(rounds)} alternating rounds")
    for n, count in enumerate(rounds):
        first, second = (fauxmad, floor_side) if n % 2 == 0 else (floor_side, fauxmad)
        first(count, ours if first is fauxmad else theirs)
        second(count, ours if second is fauxmad else theirs)
    a, b = ours.side(), theirs.side()
    return (
        FloorLevel(
            concurrency=concurrency,
            fauxmad=a,
            floor=b,
            latency_over_floor=ratios(a.create, b.create),
            throughput_over_floor=ratio(a.throughput_per_s, b.throughput_per_s),
            cpu_over_floor=ratio(a.cpu.ms_per_op or 0.0, b.cpu.ms_per_op or 0.0),
        ),
        acked,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(result: FloorResult) -> Report:
    columns = ("what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "creates/s", "CPU ms/create", "client CPU ms")
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for level in result.levels:
        for name, side in (("fauxmad", level.fauxmad), ("floor", level.floor)):
            rows.append(
                (
                    *latency_row(f"c={level.concurrency} {name}", side.create),
                    f"{side.throughput_per_s:.0f}",
                    _ms(side.cpu.ms_per_op),
                    _ms(side.client_cpu_ms_per_create),
                )
            )
        r = level.latency_over_floor
        notes.append(
            f"c={level.concurrency}: fauxmad / floor: p50 {times(r.p50)}, p99 {times(r.p99)}, throughput"
            f" {times(level.throughput_over_floor)}, CPU per create {times(level.cpu_over_floor)}"
        )
        for name, side in (("fauxmad", level.fauxmad), ("floor", level.floor)):
            if side.errors or side.refused:
                notes.append(
                    f"c={level.concurrency} {name}: {side.refused} refused, {side.errors} errors: {side.first_error}"
                )
    notes.append(f"CPU counts {result.cpu_counts}")
    notes.append(
        f"floor: {result.floor_acknowledged} reserves acknowledged, {result.floor_stream_messages} in its stream;"
        f" bus round trip p50 {result.bus_rtt.p50_ms:.3f} ms"
    )
    title = (
        f"create (reserve only) against the floor: {result.strategy}, {result.workers_per_region} workers x"
        f" {result.regions} region(s), {result.rounds} alternating rounds, gather deadline {result.deadline_ms:g} ms"
    )
    table = Table(title=title, columns=columns, align="lrrrrrrrr", rows=tuple(rows))
    return Report(tables=(table,), notes=tuple(notes))
