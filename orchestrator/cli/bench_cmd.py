"""`fauxmad bench placement|worker`: measure, print a table, write JSON. Numbers belong in notes, not tests."""

from __future__ import annotations

import asyncio
import os
import platform
import time
from pathlib import Path
from typing import Any

import msgspec
import typer
from rich.table import Table

from orchestrator.benchstats import Latency, summarize
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import NATS_HELP, fail, run

bench_app = typer.Typer(
    help="Measure placement and worker performance (prints percentiles, writes JSON).", no_args_is_help=True
)


def _latency_row(table: Table, name: str, lat: Latency, extra: str = "") -> None:
    table.add_row(
        name, str(lat.count), f"{lat.p50_ms:.2f}", f"{lat.p90_ms:.2f}", f"{lat.p99_ms:.2f}", f"{lat.max_ms:.2f}", extra
    )


def _latency_table(title: str) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for col in ("what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", ""):
        table.add_column(col, no_wrap=True, justify="right" if col not in ("what", "") else "left")
    return table


def _write(path: Path, result: Any, json_out: bool) -> None:
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2))
    if json_out:
        print_json(result)
    else:
        console.print(f"wrote {path}")


async def _echo_rtt(url: str, count: int = 500) -> Latency:
    """The bus's own request round trip on this machine, for reference."""
    import nats

    server, client = await nats.connect(url), await nats.connect(url)

    async def echo(msg: Any) -> None:
        await server.publish(msg.reply, msg.data)

    await server.subscribe("fauxmad.bench.echo", cb=echo)
    await server.flush()
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        await client.request("fauxmad.bench.echo", b"x" * 200, timeout=2)
        samples.append(time.perf_counter() - started)
    await server.close()
    await client.close()
    return summarize(samples)


class PlacementResult(msgspec.Struct, kw_only=True):
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
    host: dict[str, Any]


async def _placement_run(
    url: str, regions: list[str], count: int, concurrency: int, strategy: str, start: bool
) -> tuple[list[float], int, int, float]:
    from bus.errors import NoCapacity
    from bus.messages import CreateRequest, Guest, MachineConfig, RestartPolicy
    from orchestrator.client import FleetClient

    clients = [await FleetClient.connect(url) for _ in range(min(concurrency, 8))]
    config = MachineConfig(
        cmd=["sleep", "600"] if start else ["true"],
        guest=Guest(cpus=1, memory_mb=1),
        restart=RestartPolicy(policy="no"),
    )
    samples: list[float] = []
    refused = errors = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def one_client(index: int) -> None:
        nonlocal refused, errors
        client = clients[index % len(clients)]
        while not queue.empty():
            i = queue.get_nowait()
            request = CreateRequest(
                region=regions[i % len(regions)],
                config=config,
                skip_launch=not start,
                strategy=strategy,  # type: ignore[arg-type]
            )
            began = time.perf_counter()
            try:
                await client.create("bench", request)
                samples.append(time.perf_counter() - began)
            except NoCapacity:
                refused += 1
            except Exception:
                errors += 1

    began = time.perf_counter()
    await asyncio.gather(*[one_client(i) for i in range(concurrency)])
    wall = time.perf_counter() - began
    for client in clients:
        await client.close()
    return samples, refused, errors, wall


@bench_app.command("placement")
def placement(
    workers: int = typer.Option(10, "--workers", min=1, max=5000, help="workers per region"),
    regions_count: int = typer.Option(1, "--regions", min=1, max=20, help="number of regions"),
    strategy: str = typer.Option("scatter", "--strategy", help="scatter, p2c or hedged"),
    concurrency: int = typer.Option(1, "--concurrency", "-c", min=1, max=1024, help="creates in flight"),
    count: int = typer.Option(2000, "--count", "-n", min=1, help="creates to measure"),
    start: bool = typer.Option(False, "--start", help="create and start a process machine (default: reserve only)"),
    warmup: int = typer.Option(100, "--warmup", min=0, help="creates before measuring"),
    brokers: int = typer.Option(1, "--brokers", min=1, max=8),
    per_process: int = typer.Option(
        0,
        "--workers-per-process",
        min=0,
        max=5000,
        help="logical workers per worker process [default: 1 up to 16 workers]",
    ),
    nats: str | None = typer.Option(None, "--nats", help=NATS_HELP + "; given: use that fleet", show_default=False),
    output: Path = typer.Option(Path("bench-placement.json"), "--output", "-o", help="where to write the JSON"),
    json_out: bool = typer.Option(False, "--json", help="print the JSON result"),
) -> None:
    """Create latency (p50/p90/p99/max) and throughput, with the bus round trip for reference."""
    from orchestrator.broker.auction import STRATEGIES
    from orchestrator.devfleet import DevFleet, FleetSpec

    if strategy not in STRATEGIES:
        fail(f"unknown --strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    names = [f"b{i + 1}" for i in range(regions_count)]
    fleet = None
    url = nats
    if url is None:
        per_process = per_process or (1 if workers <= 16 else -(-workers // 8))
        spec = FleetSpec(
            regions=names,
            workers_per_region=workers,
            cpus=100_000,
            memory_mb=10_000_000,
            brokers=brokers,
            workers_per_process=per_process,
            strategy=strategy,
            heartbeat=1.0 if workers <= 100 else 2.0,
        )
        with console.status(f"starting {workers * regions_count} workers and {brokers} broker(s)"):
            fleet = DevFleet(spec).start(timeout=300)
        url = fleet.url
    try:
        if warmup:
            run(_placement_run(url, names, warmup, concurrency, strategy, start))
        with console.status(f"{count} creates at concurrency {concurrency}"):
            samples, refused, errors, wall = run(_placement_run(url, names, count, concurrency, strategy, start))
        rtt = run(_echo_rtt(url))
    finally:
        if fleet is not None:
            with console.status("stopping the fleet"):
                fleet.stop()
    result = PlacementResult(
        strategy=strategy,
        workers_per_region=workers,
        regions=regions_count,
        concurrency=concurrency,
        start=start,
        create=summarize(samples),
        throughput_per_s=round(len(samples) / wall, 1),
        refused=refused,
        errors=errors,
        bus_rtt=rtt,
        host={"cpus": os.cpu_count(), "python": platform.python_version()},
    )
    if not json_out:
        table = _latency_table(
            f"placement: {strategy}, {workers} workers x {regions_count} region(s), concurrency {concurrency}"
        )
        _latency_row(
            table,
            "create+start" if start else "create (reserve)",
            result.create,
            f"{result.throughput_per_s:.0f}/s, {refused} refused, {errors} errors",
        )
        _latency_row(table, "bus round trip", rtt)
        console.print(table)
    _write(output, result, json_out)


@bench_app.command("worker")
def worker_bench(
    reserves: int = typer.Option(2000, "--reserves", min=10, help="sequential reserves over NATS"),
    records: str = typer.Option("100000,1000000", "--records", help="log sizes for the restart measurement"),
    output: Path = typer.Option(Path("bench-worker.json"), "--output", "-o", help="where to write the JSON"),
    json_out: bool = typer.Option(False, "--json", help="print the JSON result"),
) -> None:
    """Reserve latency over NATS, commits/s with fsync, restart time vs log size, worker RSS at rest."""
    from orchestrator.cli.worker_bench import run_worker_bench  # the CLI's edge into `workers`

    try:
        sizes = [int(part) for part in records.split(",") if part.strip()]
    except ValueError:
        fail(f"invalid --records {records!r}: use numbers like 100000,1000000")
    result = run_worker_bench(reserves=reserves, sizes=sizes, progress=lambda s: console.print(f"[dim]…[/] {s}"))
    if not json_out:
        table = _latency_table("worker")
        _latency_row(table, "reserve over NATS", result.reserve)
        console.print(table)
        console.print(
            f"commits/s with fsync: {result.commits_per_s_concurrent:.0f} with 64 concurrent reservers "
            f"({result.commits_per_batch:.1f} per fsync), {result.commits_per_s_serial:.0f} one at a time"
        )
        for item in result.restart:
            console.print(
                f"restart with {item.log_records} log records: store open+scan {item.open_ms:.1f} ms, "
                f"process start to ready {item.ready_ms:.0f} ms (log {item.log_mb:.0f} MB)"
            )
        console.print(f"worker RSS at rest: {result.rss_mb_at_rest:.1f} MB")
    _write(output, result, json_out)


def _register_app_benchmarks() -> None:
    from orchestrator.cli import bench_apps

    bench_app.command("deploy")(bench_apps.deploy)
    bench_app.command("failover")(bench_apps.failover)


_register_app_benchmarks()
