"""`fauxmad bench placement --floor`: fauxmad's create beside the floor, same run, same nats-server.

One dev fleet (nats-server, workers, brokers: `placement.fleet_spec`) and, on its nats-server, the floor's
responders (`lab.bench.floor`, one per fauxmad worker), and unless `contract` is off the contract's two floors
(their own responders and a broker per region). At concurrency 1 and at the asked concurrency, each side
warms up, then rounds go through the sides in an order that turns by one each round (fauxmad, floor, ...;
floor, ..., fauxmad) so the drift of a shared machine hits all; every round adds its samples to its side.
Beside latency and throughput, the CPU of the processes each side needs (`lab.bench.cpu`: fauxmad's
nats-server, workers and brokers; a floor's nats-server, responders and broker) is summed over the measured
creates only. The client (this process, the same for every side: fauxmad's `FleetClient` or the floors'
nats-py client) is counted in none; its own CPU per create is shown apart.

Read the ratios in two steps: a contract floor over the plain floor is what the contract's parts cost any
implementation (the broker hop, the routing index entry; then the audit stream and the index replicas),
and fauxmad over a contract floor is what fauxmad's own code costs on top.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import msgspec
import uvloop

from lab.bench import BenchError
from lab.bench.cpu import CpuMeter, CpuUse, SelfMeter
from lab.bench.echo import EchoResponder
from lab.bench.floor import CONTRACT, CONTRACT_AUDITED, FLOOR, FloorResponders, FloorRun, Variant, measure_floor_creates
from lab.bench.placement import CreateRun, PlacementOptions, fleet_spec, measure_creates
from lab.bench.report import Report, Table, host_info, latency_row, times
from lab.bench.stats import Latency, Ratio, ratio, ratios, summarize
from orchestrator.devfleet import DevFleet

Progress = Callable[[str], None]


class FloorOptions(msgspec.Struct, frozen=True, kw_only=True):
    placement: PlacementOptions
    rounds: int = 4  # per concurrency; each side's count is split over them
    data_dir: str | None = None  # keep the plain floor's LMDB files there (tests read them); None: a temporary dir
    contract: bool = True  # also the contract's floors (`lab.bench.floor.CONTRACT`, `CONTRACT_AUDITED`)


class Side(msgspec.Struct, kw_only=True):
    """One side (fauxmad or the floor) at one concurrency, all its rounds together."""

    create: Latency
    throughput_per_s: float
    refused: int
    errors: int
    cpu: CpuUse  # nats-server + the side's own processes, over the measured creates
    client_cpu_ms_per_create: float | None  # this process (the client), counted in neither side's cpu
    first_error: str | None = None


class Ratios(msgspec.Struct, kw_only=True):
    """One side over another: latency (p50 / p50, p99 / p99), throughput and CPU per create."""

    latency: Ratio
    throughput: float | None
    cpu: float | None

    @classmethod
    def of(cls, a: Side, b: Side) -> Ratios:
        return cls(
            latency=ratios(a.create, b.create),
            throughput=ratio(a.throughput_per_s, b.throughput_per_s),
            cpu=ratio(a.cpu.ms_per_op or 0.0, b.cpu.ms_per_op or 0.0),
        )


class FloorLevel(msgspec.Struct, kw_only=True):
    concurrency: int
    fauxmad: Side
    floor: Side
    latency_over_floor: Ratio  # fauxmad's p50 / floor's p50, p99 / p99
    throughput_over_floor: float | None
    cpu_over_floor: float | None  # fauxmad's CPU ms/create / the floor's
    floors: dict[str, Side] = {}  # the contract's floors by name ("contract", "contract+audit"), when measured
    over_floor: dict[str, Ratios] = {}  # each contract floor over the plain floor: what the contract's parts cost
    fauxmad_over: dict[str, Ratios] = {}  # fauxmad over each contract floor: what fauxmad's own code costs


class FloorResult(msgspec.Struct, kw_only=True):
    workers_per_region: int
    regions: int
    strategy: str
    rounds: int
    deadline_ms: float
    levels: list[FloorLevel]
    floor_acknowledged: int  # reserves the floor's responders acknowledged (warm-up included)
    floor_stream_messages: int  # what their JetStream stream holds at the end: one per acknowledged reserve
    contract_acknowledged: dict[str, int] = {}  # the same for each contract floor, by name
    contract_streams: dict[str, dict[str, int]] = {}  # what each contract floor's streams hold: events, index, audit
    bus_rtt: Latency
    cpu_counts: str
    host: dict[str, object]


CPU_COUNTS = (
    "fauxmad: nats-server, worker and broker processes (and their children); a floor: nats-server, the"
    " responders and its broker; the client (this process) in none"
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
    variants = [CONTRACT, CONTRACT_AUDITED] if options.contract else []
    also = f" and the contract's {len(variants)} floors" if variants else ""
    progress(f"starting {p.workers * p.regions} workers and {p.brokers} broker(s), the floor's responders{also}")
    fleet = DevFleet(spec).start(timeout=300)
    deadline = spec.deadline_ms / 1000
    try:
        nats_pid, fleet_own = fleet_pids(fleet)
        root = Path(options.data_dir) if options.data_dir else None
        with contextlib.ExitStack() as stack:
            floors = {
                v.name: stack.enter_context(
                    FloorResponders(
                        fleet.url,
                        p.region_names,
                        p.workers,
                        root=root if v is FLOOR else None,  # only the plain floor's files are kept
                        variant=v,
                        deadline=deadline,
                    )
                )
                for v in [FLOOR, *variants]
            }
            echo = stack.enter_context(EchoResponder(fleet.url))
            loop = stack.enter_context(asyncio.Runner(loop_factory=uvloop.new_event_loop))
            levels: list[FloorLevel] = []
            acknowledged: dict[str, int] = dict.fromkeys(floors, 0)
            for concurrency in dict.fromkeys([1, p.concurrency]):
                level = _level(
                    loop, fleet.url, floors, options, concurrency, deadline, nats_pid, fleet_own, acknowledged, progress
                )
                levels.append(level)
            progress(f"{p.echo_count} bus round trips (echo in another process)")
            rtt = loop.run(echo.measure(p.echo_count))
        streams = {name: floor.held for name, floor in floors.items()}  # read once they had stopped
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
        floor_acknowledged=acknowledged.pop(FLOOR.name),
        floor_stream_messages=streams.pop(FLOOR.name).get(FLOOR.stream, 0),
        contract_acknowledged=acknowledged,
        contract_streams=streams,
        bus_rtt=rtt,
        cpu_counts=CPU_COUNTS,
        host=host_info(),
    )


def _level(
    loop: asyncio.Runner,
    url: str,
    floors: dict[str, FloorResponders],
    options: FloorOptions,
    concurrency: int,
    deadline: float,
    nats_pid: int,
    fleet_own: list[int],
    acknowledged: dict[str, int],
    progress: Progress,
) -> FloorLevel:
    """Warm-up and rounds at one concurrency, every side in each round, the order turning by one a round;
    `acknowledged` counts each floor's acknowledged reserves (warm-up included)."""
    p = options.placement
    regions = p.region_names
    tallies = {"fauxmad": _Tally([nats_pid, *fleet_own])}
    tallies |= {name: _Tally([nats_pid, *floor.pids]) for name, floor in floors.items()}

    def fauxmad(count: int, tally: _Tally | None) -> None:
        meters = (tally.cpu, tally.client) if tally else ()
        run = loop.run(
            measure_creates(
                url, regions, count=count, concurrency=concurrency, strategy=p.strategy, start=False, meters=meters
            )
        )
        if tally:
            tally.add(run)

    def floor_side(variant: Variant) -> Callable[[int, _Tally | None], None]:
        def measure(count: int, tally: _Tally | None) -> None:
            meters = (tally.cpu, tally.client) if tally else ()
            per_region = floors[variant.name].per_region
            run: FloorRun = loop.run(
                measure_floor_creates(
                    url,
                    regions,
                    per_region,
                    count=count,
                    concurrency=concurrency,
                    deadline=deadline,
                    meters=meters,
                    variant=variant,
                )
            )
            acknowledged[variant.name] += len(run.acknowledged)
            if tally:
                tally.add(run)

        return measure

    sides = {"fauxmad": fauxmad} | {name: floor_side(floor.variant) for name, floor in floors.items()}
    if p.warmup:
        progress(f"c={concurrency}: {p.warmup} creates to warm up, each side")
        for measure in sides.values():
            measure(p.warmup, None)
    rounds = split(p.count, options.rounds)
    progress(f"c={concurrency}: {p.count} creates each side ({', '.join(sides)}), in {len(rounds)} rounds")
    names = list(sides)
    for n, count in enumerate(rounds):
        turn = n % len(names)
        for name in names[turn:] + names[:turn]:
            sides[name](count, tallies[name])
    measured = {name: tally.side() for name, tally in tallies.items()}
    ours, floor = measured.pop("fauxmad"), measured.pop(FLOOR.name)
    mine = Ratios.of(ours, floor)
    return FloorLevel(
        concurrency=concurrency,
        fauxmad=ours,
        floor=floor,
        latency_over_floor=mine.latency,
        throughput_over_floor=mine.throughput,
        cpu_over_floor=mine.cpu,
        floors=measured,
        over_floor={name: Ratios.of(side, floor) for name, side in measured.items()},
        fauxmad_over={name: Ratios.of(ours, side) for name, side in measured.items()},
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio_note(label: str, r: Ratios) -> str:
    return (
        f"{label}: p50 {times(r.latency.p50)}, p99 {times(r.latency.p99)}, throughput {times(r.throughput)},"
        f" CPU per create {times(r.cpu)}"
    )


def report(result: FloorResult) -> Report:
    columns = ("what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "creates/s", "CPU ms/create", "client CPU ms")
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for level in result.levels:
        c = f"c={level.concurrency}"
        sides = {"fauxmad": level.fauxmad, "floor": level.floor} | {f"floor {n}": s for n, s in level.floors.items()}
        for name, side in sides.items():
            rows.append(
                (
                    *latency_row(f"{c} {name}", side.create),
                    f"{side.throughput_per_s:.0f}",
                    _ms(side.cpu.ms_per_op),
                    _ms(side.client_cpu_ms_per_create),
                )
            )
        mine = Ratios(
            latency=level.latency_over_floor, throughput=level.throughput_over_floor, cpu=level.cpu_over_floor
        )
        notes.append(_ratio_note(f"{c}: fauxmad / floor", mine))
        for name, r in level.over_floor.items():
            notes.append(_ratio_note(f"{c}: floor {name} / floor (the contract's parts)", r))
        for name, r in level.fauxmad_over.items():
            notes.append(_ratio_note(f"{c}: fauxmad / floor {name} (fauxmad's own code)", r))
        for name, side in sides.items():
            if side.errors or side.refused:
                notes.append(f"{c} {name}: {side.refused} refused, {side.errors} errors: {side.first_error}")
    notes.append(f"CPU counts {result.cpu_counts}")
    notes.append(
        f"floor: {result.floor_acknowledged} reserves acknowledged, {result.floor_stream_messages} in its stream;"
        f" bus round trip p50 {result.bus_rtt.p50_ms:.3f} ms"
    )
    for name, acked in result.contract_acknowledged.items():
        held = ", ".join(f"{stream} {count}" for stream, count in result.contract_streams.get(name, {}).items())
        notes.append(f"floor {name}: {acked} reserves acknowledged; its streams hold {held}")
    if result.contract_acknowledged:
        notes.append(
            "floor contract: a broker between client and responders, and the routing index entry stored before"
            " the reply; floor contract+audit: also the audit record in a stream of its own after the reply, and"
            " the broker following the index (docs/benchmarks.md says more)"
        )
    title = (
        f"create (reserve only) against the floor: {result.strategy}, {result.workers_per_region} workers x"
        f" {result.regions} region(s), {result.rounds} rounds, gather deadline {result.deadline_ms:g} ms"
    )
    table = Table(title=title, columns=columns, align="lrrrrrrrr", rows=tuple(rows))
    return Report(tables=(table,), notes=tuple(notes))
