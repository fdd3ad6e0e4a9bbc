"""Placement: create latency and throughput on a fleet of N workers, with the bus round trip beside it.

With `supercluster=N` the fleet is a loopback supercluster (a NATS cluster of N servers per region, joined
by gateways: docs/how-to/supercluster.md), and each region's creates go through clients connected to that
region's own servers, as its processes are; `run_comparison` measures one server and then the supercluster
with the same options, in the same run.

`run_placement` starts its own fleet (unless given a NATS URL): embedded NATS, worker processes with
room for everything (so nothing is refused for capacity), one or more brokers. It creates machines at
a fixed concurrency through `FleetClient` (the CLI's client), reserve only (`skip_launch`) or started
(`sleep 600`), and measures the bus round trip in the same run with an echo responder in another
process (`echo`), so `create p50 / echo p50` compares like with like on this host.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import msgspec
import uvloop

from bus.contract.errors import NoCapacity
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig, RestartPolicy
from lab.bench.cpu import Meter
from lab.bench.echo import EchoResponder
from lab.bench.report import Report, host_info, latency_table, times
from lab.bench.stats import Latency, ratio, summarize
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec

APP = "bench"
MAX_CLIENTS = 8  # connections shared by the concurrent creators
TARGET_OVER_RTT = 5.0  # the goal: create p50 within 5x the bus round trip


class PlacementOptions(msgspec.Struct, frozen=True, kw_only=True):
    workers: int = 10  # per region
    regions: int = 1
    strategy: str = "scatter"
    concurrency: int = 1
    count: int = 2000
    start: bool = False  # create and start a process (default: reserve only)
    warmup: int = 100
    brokers: int = 1
    workers_per_process: int = 0  # 0: 1 up to 16 workers per region, else about 8 processes
    nats: str | None = None  # measure that fleet instead of starting one
    echo_count: int = 500
    supercluster: int = 0  # servers per region of a loopback supercluster; 0: one nats-server
    wan_delay: float = 0.0  # the supercluster's gateway links: seconds one way (`bus.local.gateway_relay`)

    @property
    def region_names(self) -> list[str]:
        return [f"b{i + 1}" for i in range(self.regions)]


class CreateRun(msgspec.Struct, kw_only=True):
    """What one loop of creates saw: the successful ones' latencies, refusals, other errors, wall time."""

    samples: list[float]
    refused: int
    errors: int
    wall_s: float
    first_error: str | None = None
    first_refusal: str | None = None
    by_region: dict[str, list[float]] = {}  # the successful creates' latencies of each region


class PlacementResult(msgspec.Struct, kw_only=True):
    layout: str
    strategy: str
    workers_per_region: int
    regions: int
    concurrency: int
    start: bool
    create: Latency
    throughput_per_s: float
    refused: int
    errors: int
    bus_rtt: Latency
    create_p50_over_bus_rtt_p50: float | None
    host: dict[str, object]
    first_error: str | None = None
    first_refusal: str | None = None
    wan_delay_ms: float = 0.0  # one way, between the supercluster's regions
    per_region: dict[str, Latency] = {}  # with several regions: each one's creates (through its own servers)


def fleet_spec(options: PlacementOptions) -> FleetSpec:
    """A fleet where capacity never refuses a create: what is measured is the auction, not a full fleet."""
    workers = options.workers
    per_process = options.workers_per_process or (1 if workers <= 16 else -(-workers // 8))
    return FleetSpec(
        regions=options.region_names,
        workers_per_region=workers,
        cpus=100_000,
        memory_mb=10_000_000,
        brokers=options.brokers,
        workers_per_process=per_process,
        strategy=options.strategy,
        heartbeat=1.0 if workers <= 100 else 2.0,
        supercluster=options.supercluster,
        wan_delay=options.wan_delay if options.supercluster else 0.0,
    )


@contextlib.contextmanager
def fleet_url(options: PlacementOptions, progress: Callable[[str], None]) -> Iterator[str]:
    """The NATS URL to measure: `options.nats`, or a fleet of our own, stopped (machines destroyed) after."""
    with fleet_urls(options, progress) as (url, _):
        yield url


@contextlib.contextmanager
def fleet_urls(options: PlacementOptions, progress: Callable[[str], None]) -> Iterator[tuple[str, dict[str, str]]]:
    """`fleet_url`, with each region's own URL beside it (in a supercluster; else every region's is the one)."""
    if options.nats is not None:
        yield options.nats, dict.fromkeys(options.region_names, options.nats)
        return
    total = options.workers * options.regions
    where = f" on a supercluster of {options.supercluster} server(s) per region" if options.supercluster else ""
    progress(f"starting {total} workers and {options.brokers} broker(s){where}")
    fleet = DevFleet(fleet_spec(options)).start(timeout=300)
    try:
        yield fleet.url, {region: fleet.region_url(region) for region in options.region_names}
    finally:
        progress("stopping the fleet")
        fleet.stop()


def machine_config(start: bool) -> MachineConfig:
    return MachineConfig(
        cmd=["sleep", "600"] if start else ["true"],
        guest=Guest(cpus=1, memory_mb=64 if start else 1),
        restart=RestartPolicy(policy="no"),
    )


async def metered(creators: list[Coroutine[Any, Any, None]], meters: Sequence[Meter]) -> float:
    """Run the creators together between the meters' start and stop; the wall time they took, in seconds."""
    for meter in meters:
        meter.start()
    began = time.perf_counter()
    try:
        await asyncio.gather(*creators)
    finally:
        for meter in meters:
            meter.stop()
    return time.perf_counter() - began


async def measure_creates(
    url: str,
    regions: list[str],
    *,
    count: int,
    concurrency: int,
    strategy: str,
    start: bool,
    region_urls: dict[str, str] | None = None,
    meters: Sequence[Meter] = (),
) -> CreateRun:
    """`count` creates, `concurrency` in flight, round robin over `regions`; with `region_urls`, a region's
    creates go through clients connected to that region's URL; `meters` run around the creates alone."""
    urls = region_urls or dict.fromkeys(regions, url)
    per = min(concurrency, MAX_CLIENTS)
    clients = {
        region: [await FleetClient.connect(urls[region], name="fauxmad-bench") for _ in range(per)]
        for region in dict.fromkeys(regions)
    }
    config = machine_config(start)
    run = CreateRun(samples=[], refused=0, errors=0, wall_s=0.0, by_region={region: [] for region in clients})
    todo = iter(range(count))

    async def creator(index: int) -> None:
        for i in todo:  # shared: each creator takes the next number
            client = clients[regions[i % len(regions)]][index % per]
            request = CreateRequest(
                region=regions[i % len(regions)],
                config=config,
                skip_launch=not start,
                strategy=strategy,  # type: ignore[arg-type]
            )
            began = time.perf_counter()
            try:
                await client.create(APP, request)
                run.samples.append(took := time.perf_counter() - began)
                run.by_region[request.region].append(took)
            except NoCapacity as exc:
                run.refused += 1
                run.first_refusal = run.first_refusal or exc.message
            except Exception as exc:
                run.errors += 1
                run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"

    try:
        run.wall_s = await metered([creator(i) for i in range(concurrency)], meters)
    finally:
        for group in clients.values():
            for client in group:
                await client.close()
    return run


def run_placement(options: PlacementOptions, progress: Callable[[str], None] = lambda line: None) -> PlacementResult:
    """Warm up, measure the creates, then the bus round trip (on the same event loop), and summarize."""
    regions = options.region_names
    with (
        fleet_urls(options, progress) as (url, region_urls),
        EchoResponder(url) as echo,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop,
    ):

        def creates(count: int) -> Coroutine[Any, Any, CreateRun]:
            return measure_creates(
                url,
                regions,
                count=count,
                concurrency=options.concurrency,
                strategy=options.strategy,
                start=options.start,
                region_urls=region_urls,
            )

        if options.warmup:
            progress(f"{options.warmup} creates to warm up")
            loop.run(creates(options.warmup))
        progress(f"{options.count} creates at concurrency {options.concurrency}")
        run = loop.run(creates(options.count))
        progress(f"{options.echo_count} bus round trips (echo in another process)")
        rtt = loop.run(echo.measure(options.echo_count))
    create = summarize(run.samples)
    return PlacementResult(
        layout=f"supercluster, {options.supercluster} server(s) per region" if options.supercluster else "one server",
        strategy=options.strategy,
        workers_per_region=options.workers,
        regions=options.regions,
        concurrency=options.concurrency,
        start=options.start,
        create=create,
        throughput_per_s=round(len(run.samples) / run.wall_s, 1) if run.wall_s > 0 else 0.0,
        refused=run.refused,
        errors=run.errors,
        bus_rtt=rtt,
        create_p50_over_bus_rtt_p50=ratio(create.p50_ms, rtt.p50_ms),
        host=host_info(),
        first_error=run.first_error,
        first_refusal=run.first_refusal,
        wan_delay_ms=options.wan_delay * 1000 if options.supercluster else 0.0,
        per_region={r: summarize(samples) for r, samples in run.by_region.items()} if len(regions) > 1 else {},
    )


def report(result: PlacementResult) -> Report:
    what = "create+start" if result.start else "create (reserve)"
    wan = f", {result.wan_delay_ms:g} ms one way between regions" if result.wan_delay_ms else ""
    title = (
        f"placement on {result.layout}{wan}: {result.strategy}, {result.workers_per_region} workers x {result.regions}"
        f" region(s), concurrency {result.concurrency}"
    )
    notes = [
        f"throughput {result.throughput_per_s:.0f}/s, {result.refused} refused, {result.errors} errors",
        f"create p50 / bus round trip p50: {times(result.create_p50_over_bus_rtt_p50)} "
        f"(target <= {TARGET_OVER_RTT:g}x; echo one at a time)",
    ]
    if result.first_error:
        notes.append(f"first error: {result.first_error}")
    if result.first_refusal:
        notes.append(f"first refusal: {result.first_refusal}")
    rows = [(what, result.create), *((f"{what} in {r}", latency) for r, latency in result.per_region.items())]
    table = latency_table(title, [*rows, ("bus round trip (echo, other process)", result.bus_rtt)])
    return Report(tables=(table,), notes=tuple(notes))


class PlacementComparison(msgspec.Struct, kw_only=True):
    """The same measurement on one server and on a supercluster, one after the other."""

    one_server: PlacementResult
    supercluster: PlacementResult


def run_comparison(
    options: PlacementOptions, progress: Callable[[str], None] = lambda line: None
) -> PlacementComparison:
    """`run_placement` on one server, then on a supercluster of `options.supercluster` servers per region."""
    assert options.supercluster > 0 and options.nats is None
    one = run_placement(msgspec.structs.replace(options, supercluster=0), progress)
    return PlacementComparison(one_server=one, supercluster=run_placement(options, progress))


def comparison_report(result: PlacementComparison) -> Report:
    one, sc = report(result.one_server), report(result.supercluster)
    return Report(tables=(*one.tables, *sc.tables), notes=(*one.notes, *sc.notes))
