"""`fauxmad workers`, `fauxmad regions`, `fauxmad dev` and `fauxmad demo`: the fleet as a whole."""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import typer

from orchestrator.cli.render import console, explain_table, machines_table, print_json, regions_table, workers_table
from orchestrator.cli.runtime import NATS_HELP, check_region, check_regions, fail, run, split_names, with_client

NATS = typer.Option(None, "--nats", help=NATS_HELP, show_default=False)
JSON = typer.Option(False, "--json", help="print JSON instead of a table")
EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def workers(
    region: str | None = typer.Option(None, "--region", "-r", help="only this region", callback=check_region),
    nats: str | None = NATS,
    json_out: bool = JSON,
) -> None:
    """The live workers (from their heartbeats) with capacity and utilization."""
    infos = with_client(nats, lambda c: c.workers(region))
    if json_out:
        print_json(infos)
    elif not infos:
        console.print("no live workers" + (f" in {region}" if region else ""))
    else:
        console.print(workers_table(infos))


def regions(nats: str | None = NATS, json_out: bool = JSON) -> None:
    """Regions with their workers, capacity and utilization."""
    summaries = with_client(nats, lambda c: c.regions())
    if json_out:
        print_json(summaries)
    elif not summaries:
        console.print("no regions: no live workers")
    else:
        console.print(regions_table(summaries))


def _fleet_spec(regions_csv: str, per_region: int, cpus: int, memory_mb: int, port: int | None) -> Any:
    from orchestrator.devfleet import FleetSpec

    names = split_names("region", regions_csv)
    if not names:
        fail("--regions needs at least one region, e.g. mad,syd,gru")
    return FleetSpec(regions=names, workers_per_region=per_region, cpus=cpus, memory_mb=memory_mb, port=port)


def _wait_for_ctrl_c() -> None:
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        while not stop["now"]:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass


def dev(
    regions_csv: str = typer.Option(
        "mad,syd,gru", "--regions", help="comma-separated region names", callback=check_regions
    ),
    workers_per_region: int = typer.Option(3, "--workers-per-region", min=1, max=50),
    cpus: int = typer.Option(4, "--cpus", min=1, help="cpus per worker"),
    memory_mb: int = typer.Option(4096, "--memory-mb", min=64, help="memory per worker"),
    port: int | None = typer.Option(None, "--port", min=1, max=65535, help="NATS port [default: a free one]"),
) -> None:
    """A local fleet in the foreground: NATS, workers per region (real processes) and a broker. Ctrl-C stops all."""
    from orchestrator.devfleet import DevFleet

    spec = _fleet_spec(regions_csv, workers_per_region, cpus, memory_mb, port)
    fleet = DevFleet(spec, progress=lambda line: console.print(f"[dim]…[/] {line}"))
    with console.status("starting the fleet"):
        fleet.start()
    try:
        console.print(f"\n[bold green]fleet up[/]: NATS at [bold]{fleet.url}[/]\n")
        console.print("try, in another terminal:")
        console.print(f"  export FAUXMAD_NATS_URL={fleet.url}")
        console.print("  fauxmad workers")
        console.print(
            f"  fauxmad machine run --app hello --region {spec.regions[0]} --explain -- "
            "python3 -m http.server --bind 127.0.0.1 \\$PORT"
        )
        console.print("  fauxmad machine list --app hello\n")
        console.print("[dim]Ctrl-C stops everything[/]")
        _wait_for_ctrl_c()
    finally:
        with console.status("stopping the fleet"):
            fleet.stop()
        console.print("fleet stopped; nothing left running")


def demo(
    keep: bool = typer.Option(False, "--keep", help="leave the fleet running until Ctrl-C"),
    regions_csv: str = typer.Option(
        "mad,syd,gru", "--regions", help="comma-separated region names", callback=check_regions
    ),
    workers_per_region: int = typer.Option(3, "--workers-per-region", min=1, max=20),
) -> None:
    """Start a dev fleet, run the sandwich-rating app in three regions, show where it landed and why."""
    from orchestrator.devfleet import DevFleet

    spec = _fleet_spec(regions_csv, workers_per_region, 4, 4096, None)
    fleet = DevFleet(spec, progress=lambda line: console.print(f"[dim]…[/] {line}"))
    with console.status("starting a dev fleet: nats-server, workers, broker"):
        fleet.start()
    try:
        machines = _demo_run(fleet.url, spec.regions)
        if keep:
            console.print(f"\nfleet left running at [bold]{fleet.url}[/]; Ctrl-C stops it")
            _wait_for_ctrl_c()
    finally:
        with console.status("stopping the fleet"):
            fleet.stop()
    console.print(f"[bold green]demo done[/]: {len(machines)} machines placed, served and cleaned up")


def _demo_run(url: str, region_names: list[str]) -> list[Any]:
    from bus.messages import Check, CreateRequest, Guest, MachineConfig
    from orchestrator.client import FleetClient

    app_file = EXAMPLES / "sandwich" / "app.py"
    config = MachineConfig(
        cmd=[sys.executable, str(app_file)],
        guest=Guest(cpus=1, memory_mb=128),
        image="examples/sandwich:1",
        checks={"http": Check(type="http", path="/health", interval="500ms", timeout="1s")},
    )

    async def place() -> list[tuple[Any, float]]:
        client = await FleetClient.connect(url)
        try:
            placed = []
            for region in region_names:
                started = time.perf_counter()
                machine = await client.create("sandwich", CreateRequest(region=region, config=config, explain=True))
                placed.append((machine, (time.perf_counter() - started) * 1000))
            for machine, _ in placed:
                await client.wait("sandwich", machine.id, "started", timeout=10)
            return placed
        finally:
            await client.close()

    async def fleet_view() -> Any:
        client = await FleetClient.connect(url)
        try:
            return await client.workers(), [await client.get("sandwich", m.id) for m, _ in placed]
        finally:
            await client.close()

    console.rule("sandwich ratings, one machine per region")
    placed = run(place())
    for machine, ms in placed:
        console.print(
            f"[bold]{machine.region}[/]: machine {machine.id} on [bold]{machine.worker_id}[/] "
            f"(placed and started in {ms:.1f} ms)"
        )
        if machine.explain:
            console.print(explain_table(machine.explain))
    time.sleep(0.5)
    console.rule("each machine answers on its own port")
    for machine, _ in placed:
        body = _http_get(f"http://127.0.0.1:{machine.port}/")
        console.print(f"{machine.region} :{machine.port} -> {body}")
    console.rule("the fleet")
    infos, machines = run(fleet_view())  # heartbeats carry usage within a few tens of milliseconds
    console.print(workers_table(infos))
    console.print(machines_table(machines, title="machines of app sandwich (health checks from the workers)"))
    return [m for m, _ in placed]


def _http_get(url: str) -> str:
    for _ in range(50):
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                return json.dumps(json.loads(response.read()))
        except OSError:
            time.sleep(0.1)
    return "(no answer)"
