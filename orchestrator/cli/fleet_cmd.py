"""`fauxmad workers`, `regions`, `dev`, `demo`: the fleet as a whole; `fauxmad fleet`: the named fleets."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.text import Text

from bus.transport.connection import DEFAULT_URL_ENV
from orchestrator.cli.names import require_regions
from orchestrator.cli.render import (
    WideOption,
    console,
    explain_table,
    heading,
    literal,
    machines_table,
    print_json,
    regions_table,
    workers_table,
)
from orchestrator.cli.runtime import (
    EXIT_USAGE,
    FleetsConfig,
    JsonOption,
    NatsOption,
    check_fleet_name,
    check_region,
    check_regions,
    check_url,
    config_path,
    fail,
    load_config,
    run,
    save_config,
    split_names,
    with_client,
)

if TYPE_CHECKING:
    from bus.contract.fleet import WorkerInfo
    from bus.contract.machines import Machine
    from orchestrator.client import FleetClient
    from orchestrator.devfleet import DevFleet, FleetSpec

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def workers(
    region: str | None = typer.Option(None, "--region", "-r", help="only this region", callback=check_region),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """The live workers (from their heartbeats) with capacity and utilization."""

    async def live(client: FleetClient) -> list[WorkerInfo]:
        found = await client.workers(region)
        if region is not None and not found:
            await require_regions(client, [region])
        return found

    infos = with_client(nats, live)
    if json_out:
        print_json(infos)
    elif not infos:
        console.print("no live workers" + (f" in {region}" if region else ""))
    else:
        console.print(workers_table(infos))


def regions(nats: str | None = NatsOption, json_out: bool = JsonOption, wide: bool = WideOption) -> None:
    """Regions with their workers, capacity and utilization."""
    summaries = with_client(nats, lambda c: c.regions())
    if json_out:
        print_json(summaries)
    elif not summaries:
        console.print("no regions: no live workers")
    else:
        console.print(regions_table(summaries))


def _fleet_spec(regions_csv: str, per_region: int, cpus: int, memory_mb: int, port: int | None) -> FleetSpec:
    from orchestrator.devfleet import FleetSpec

    names = split_names("region", regions_csv)
    if not names:
        fail("--regions needs at least one region, e.g. mad,syd,gru")
    return FleetSpec(regions=names, workers_per_region=per_region, cpus=cpus, memory_mb=memory_mb, port=port)


# The command `fauxmad dev` suggests, verbatim. No shell runs a machine's command (its argv is exec'd
# as given), so `$PORT` is expanded by a shell the command starts itself: the worker does not invent
# shell semantics, and what a user pastes is what runs. `exec` makes the server the machine's process.
HELLO_CMD = ["sh", "-c", 'exec python3 -m http.server --bind 127.0.0.1 "$PORT"']  # local: machines listen on loopback


def hello_hint(region: str) -> str:
    """The `machine run` line `fauxmad dev` prints: pasted into a POSIX shell, it runs HELLO_CMD."""
    return shlex.join(
        ["fauxmad", "machine", "run", "--app", "hello", "--region", region, "--explain", "--", *HELLO_CMD]
    )


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _fleet_lifetime(fleet: DevFleet) -> Iterator[None]:
    """Stop `fleet` (its machines, processes, NATS and data dir) however the block is left.

    SIGTERM and SIGHUP (a closed terminal) unwind like Ctrl-C, so they clean up too; while the fleet
    stops, these signals are ignored: stopping is bounded, and a second Ctrl-C must not leave half of it.
    """
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {
        sig: signal.signal(sig, _interrupt if sig != signal.SIGINT else signal.default_int_handler) for sig in stops
    }
    try:
        yield
    finally:
        for sig in stops:
            signal.signal(sig, signal.SIG_IGN)
        try:
            with console.status("stopping the fleet"):
                fleet.stop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _wait_for_ctrl_c() -> None:
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)


def _port_free(port: int, host: str = "127.0.0.1") -> bool:  # local: `fauxmad dev` starts NATS on this host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server does: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _start(fleet: DevFleet, what: str) -> None:
    from bus.contract.errors import FauxmadError

    try:
        with console.status(what):
            fleet.start()
    except FauxmadError as exc:
        fail(f"the fleet did not start: {exc.message}")


def _on_hosts(spec: FleetSpec, hosts: int, *, others: bool) -> FleetSpec:
    """`fauxmad dev --hosts N`'s spec, or a one-line reason it cannot run here."""
    import msgspec

    from orchestrator.devhosts import unavailable

    if hosts < 2:
        fail("--hosts: at least 2 (host a runs NATS, the broker and the edge; the workers run on the others)")
    if others:
        fail("--hosts puts NATS on the hosts' own addresses at the standard ports: leave out --port")
    why = unavailable()
    if why:
        fail(f"--hosts: {why}")
    return msgspec.structs.replace(spec, hosts=hosts)


def _print_hosts(fleet: DevFleet) -> None:
    """Each host of a fleet of hosts: its address, namespace and what runs on it; then the edge (else nothing)."""
    if fleet.hosts is None:
        return
    for host in fleet.hosts.hosts:
        on = sorted(name for name, where in fleet.placement.items() if where == host)
        line = f"  host {host.name} {host.address} ({host.netns}): {', '.join(on) or 'nothing'}"
        console.print(
            line + (", nats-server" if host.index == 0 else ""), soft_wrap=True, markup=False, highlight=False
        )
    console.print(f"  the edge: http://{fleet.edge} (Host: <app>.localhost)\n", markup=False, highlight=False)


def _print_hints(fleet: DevFleet, regions: list[str]) -> None:
    """The lines to paste into another terminal: the exports, a first few commands, a secure fleet's services."""
    if fleet.supercluster is not None:
        for region in regions:
            console.print(f"  {region}: {fleet.region_url(region)}", soft_wrap=True, markup=False, highlight=False)
        console.print("  (any region's URL reaches every region; a process connects to its own)\n")
    console.print("try, in another terminal:")
    exports = [f"export {DEFAULT_URL_ENV}={fleet.url}"]
    if fleet.supercluster is not None:
        exports.append(f"export FAUXMAD_SUPERCLUSTER={','.join(regions)}")
    if fleet.operator_creds:
        exports.append(f"export FAUXMAD_CREDS={fleet.operator_creds}")
    services = []  # a secure fleet's edge and HTTP API, each as its own identity (`proxy-1`, `api-1`)
    if fleet.security is not None:
        key = fleet.security.root / "token.key"  # the API's tokens: `mint` makes the key and the first token
        services = [
            f"FAUXMAD_CREDS={fleet.creds_of('proxy-1')} fauxmad proxy --region {regions[0]}",
            f"fauxmad token mint --key {key}",
            f"FAUXMAD_CREDS={fleet.creds_of('api-1')} fauxmad api --token-key {key}",
        ]
    for line in (
        *exports,
        "fauxmad workers",
        hello_hint(regions[0]),
        "fauxmad machine list --app hello",
        *services,
    ):  # verbatim: one line each, never wrapped or highlighted, so they paste as they are
        console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)


def dev(
    regions_csv: str = typer.Option(
        "mad,syd,gru", "--regions", help="comma-separated region names", callback=check_regions
    ),
    workers_per_region: int = typer.Option(3, "--workers-per-region", min=1, max=50),
    cpus: int = typer.Option(4, "--cpus", min=1, help="cpus per worker"),
    memory_mb: int = typer.Option(4096, "--memory-mb", min=64, help="memory per worker"),
    port: int | None = typer.Option(None, "--port", min=1, max=65535, help="NATS port [default: a free one]"),
    secure: bool = typer.Option(
        False,
        "--secure",
        help="mutual TLS and an identity with least privilege per process (docs/how-to/secure-fleet.md)",
    ),
    supercluster: bool = typer.Option(
        False,
        "--supercluster",
        help="a NATS cluster per region joined by gateways, a broker and an operator per region, each process"
        " connected to its own region (docs/how-to/supercluster.md)",
    ),
    servers_per_region: int = typer.Option(
        3, "--servers-per-region", min=1, max=5, help="with --supercluster: nats-servers per region (R3 needs 3)"
    ),
    cluster: int = typer.Option(
        0,
        "--cluster",
        min=0,
        max=5,
        help="one NATS cluster of N servers (routes, no gateways): with 3, every bucket and stream is R3",
    ),
    hosts: int = typer.Option(
        0,
        "--hosts",
        min=0,
        max=20,
        help="N hosts with their own addresses (network namespaces on a bridge; root, Linux): NATS, the broker and"
        " the edge on host a, the workers on the others, this shell the laptop",
    ),
) -> None:
    """A local fleet in the foreground: NATS, workers per region (real processes) and a broker. Ctrl-C stops all."""
    import msgspec

    from orchestrator.devfleet import DevFleet

    spec = msgspec.structs.replace(_fleet_spec(regions_csv, workers_per_region, cpus, memory_mb, port), secure=secure)
    if supercluster:
        if port is not None:
            fail("--supercluster picks free ports for its servers: leave out --port")
        spec = msgspec.structs.replace(spec, supercluster=servers_per_region, operators=True)
    if cluster:
        if supercluster or port is not None:
            fail("--cluster picks free ports for its servers, and is one cluster: leave out --port and --supercluster")
        spec = msgspec.structs.replace(spec, cluster=cluster)
    if hosts:
        spec = _on_hosts(spec, hosts, others=port is not None)
    if port is not None and not _port_free(port):
        fail(f"port {port} is in use: choose another --port, or leave --port out for a free one")
    fleet = DevFleet(spec, progress=lambda line: console.print(Text.assemble(("…", "dim"), " ", literal(line))))
    with _fleet_lifetime(fleet):
        _start(fleet, "starting the fleet")
        console.print(Text.assemble("\n", ("fleet up", "bold green"), ": NATS at ", (fleet.url, "bold"), "\n"))
        _print_hosts(fleet)
        _print_hints(fleet, spec.regions)
        console.print(Text("\nCtrl-C stops everything", "dim"))
        console.file.flush()  # the hints must reach a pipe (`fauxmad dev | tee`) now, not at exit
        _wait_for_ctrl_c()
    console.print("fleet stopped; nothing left running")


def demo(
    keep: bool = typer.Option(False, "--keep", help="leave the fleet running until Ctrl-C"),
    regions_csv: str = typer.Option(
        "mad,syd,gru", "--regions", help="comma-separated region names", callback=check_regions
    ),
    workers_per_region: int = typer.Option(3, "--workers-per-region", min=1, max=20),
    json_out: bool = typer.Option(
        False, "--json", help="print the machines and their answers as JSON (the story goes to stderr)"
    ),
) -> None:
    """Start a dev fleet, run the sandwich-rating app in three regions, show where it landed and why."""
    from orchestrator.devfleet import DevFleet

    spec = _fleet_spec(regions_csv, workers_per_region, 4, 4096, None)
    answers: dict[str, object] = {}
    with contextlib.redirect_stdout(sys.stderr) if json_out else contextlib.nullcontext():
        fleet = DevFleet(spec, progress=lambda line: console.print(Text.assemble(("…", "dim"), " ", literal(line))))
        with _fleet_lifetime(fleet):
            _start(fleet, "starting a dev fleet: nats-server, workers, broker")
            machines = _demo_run(fleet.url, spec.regions, answers)
            if keep:
                console.print(Text.assemble("\nfleet left running at ", (fleet.url, "bold"), "; Ctrl-C stops it"))
                _wait_for_ctrl_c()
        console.print(
            Text.assemble(("demo done", "bold green"), f": {len(machines)} machines placed, served and cleaned up")
        )
    if json_out:
        print_json({"machines": machines, "answers": answers})


def _demo_run(url: str, region_names: list[str], answers: dict[str, object]) -> list[Machine]:
    """Place one machine per region and show it; `answers` gets each machine's HTTP answer by id."""
    from bus.contract.fleet import CreateRequest
    from bus.contract.machines import Check, Guest, MachineConfig
    from orchestrator.client import FleetClient

    app_file = EXAMPLES / "sandwich" / "app.py"
    config = MachineConfig(
        cmd=[sys.executable, str(app_file)],
        guest=Guest(cpus=1, memory_mb=128),
        image="examples/sandwich:1",
        checks={"http": Check(type="http", path="/health", interval="500ms", timeout="1s")},
    )

    async def place() -> list[tuple[Machine, float]]:
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

    async def fleet_view() -> tuple[list[WorkerInfo], list[Machine]]:
        client = await FleetClient.connect(url)
        try:
            return await client.workers(), [await client.get("sandwich", m.id) for m, _ in placed]
        finally:
            await client.close()

    heading("sandwich ratings, one machine per region")
    placed = run(place())
    for machine, ms in placed:
        console.print(
            Text.assemble(
                (machine.region, "bold"),
                f": machine {machine.id} on ",
                (machine.worker_id, "bold"),
                f" (placed and started in {ms:.1f} ms)",
            )
        )
        if machine.explain:
            console.print(explain_table(machine.explain))
    time.sleep(0.5)
    heading("each machine answers on its own port")
    for machine, _ in placed:
        body = _http_get(f"http://127.0.0.1:{machine.port}/")  # local: the demo's fleet runs on this host
        answers[machine.id] = json.loads(body) if body.startswith("{") else body
        console.print(f"{machine.region} :{machine.port} -> {body}", markup=False, highlight=False)
    heading("the fleet")
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


# ---------------------------------------------------------------------------------------------------
# `fauxmad fleet ...`: named fleets in the config file

fleet_app = typer.Typer(
    help="Named fleets (NATS URLs) in $XDG_CONFIG_HOME/fauxmad/config.toml; `--fleet NAME` picks one per command.",
    no_args_is_help=True,
)
FLEET_NAME = typer.Argument(
    ..., help="a name for the fleet (letters, digits, '-', '_')", show_default=False, callback=check_fleet_name
)


@fleet_app.command("list")
def fleet_list(json_out: bool = JsonOption) -> None:
    """The named fleets; `*` marks the current one (used when neither --nats, --fleet nor $FAUXMAD_NATS_URL is)."""
    config = load_config()
    env_url = os.environ.get(DEFAULT_URL_ENV)
    if json_out:
        fleets = [{"name": n, "url": u, "current": n == config.current} for n, u in sorted(config.fleets.items())]
        print_json({"path": str(config_path()), "current": config.current, "fleets": fleets, "env": env_url})
        return
    if not config.fleets:
        console.print(f"no fleets in {config_path()}: add one with `fauxmad fleet add NAME URL --use`", highlight=False)
    for name, url in sorted(config.fleets.items()):
        mark = "*" if name == config.current else " "
        console.print(f"{mark} {name:<20} {url}", markup=False, highlight=False)
    if env_url:
        console.print(f"(${DEFAULT_URL_ENV}={env_url} is set: it comes before the current fleet)", markup=False)


@fleet_app.command("add")
def fleet_add(
    name: str = FLEET_NAME,
    url: str = typer.Argument(..., help="its NATS URL, e.g. nats://10.0.0.5:4222", show_default=False),
    use: bool = typer.Option(False, "--use", help="make it the current fleet too"),
) -> None:
    """Add (or change the URL of) a named fleet."""
    url = check_url(url)
    config = load_config()
    fleets = {**config.fleets, name: url}
    current = name if use or config.current is None else config.current
    path = save_config(FleetsConfig(current=current, fleets=fleets))
    console.print(f"fleet {name} = {url}" + (" (current)" if current == name else "") + f" in {path}", markup=False)


@fleet_app.command("use")
def fleet_use(name: str = FLEET_NAME) -> None:
    """Make a named fleet the current one."""
    config = load_config()
    if name not in config.fleets:
        known = ", ".join(sorted(config.fleets)) or "none yet"
        fail(f"no fleet named {name!r} (known: {known}; see `fauxmad fleet add`)", EXIT_USAGE)
    save_config(FleetsConfig(current=name, fleets=config.fleets))
    console.print(f"current fleet: {name} ({config.fleets[name]})", markup=False)


@fleet_app.command("remove")
def fleet_remove(name: str = FLEET_NAME) -> None:
    """Forget a named fleet (if it was the current one, there is no current fleet any more)."""
    config = load_config()
    if name not in config.fleets:
        fail(f"no fleet named {name!r}", EXIT_USAGE)
    fleets = {n: u for n, u in config.fleets.items() if n != name}
    save_config(FleetsConfig(current=None if config.current == name else config.current, fleets=fleets))
    console.print(f"fleet {name} removed", markup=False)
