"""`fauxmad fleet init|add-worker|add-user|revoke|reload`: a secure fleet's CA, identities and server config.

Thin: the work is in `orchestrator.security` (what is written and why); this parses, calls and prints.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TypeVar

import typer

from bus.contract.errors import BadRequest
from bus.stores.images import Images
from bus.stores.secrets import secrets_bucket
from bus.stores.snapshots import snapshot_store, volumes_bucket
from bus.transport.connection import connect
from bus.transport.jetstream import (
    ensure_audit_stream,
    ensure_fleet_resources,
    ensure_jobs_resources,
    revoked_tokens_bucket,
)
from bus.transport.nats_adapter import Nats
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import (
    EXIT_USAGE,
    JsonOption,
    NatsOption,
    check_regions,
    fail,
    split_names,
    with_connected,
)
from orchestrator.security.fleetdir import FleetDir, FleetDirError
from orchestrator.security.roles import ROLES

USER_ROLES = ", ".join(role for role in ROLES if role != "worker")
DIR_OPTION = typer.Option(
    ..., "--dir", "-d", help="the fleet directory that `fauxmad fleet init` made", show_default=False
)


def register(fleet_app: typer.Typer) -> None:
    fleet_app.command("init")(init)
    fleet_app.command("add-worker")(add_worker)
    fleet_app.command("add-user")(add_user)
    fleet_app.command("revoke")(revoke)
    fleet_app.command("reload")(reload)
    fleet_app.command("rotate")(rotate)
    fleet_app.command("prepare")(prepare)


def init(
    directory: str = typer.Argument(..., help="where to write the fleet's CA, server config and credentials"),
    host: str = typer.Option(
        "127.0.0.1",  # local: a one-host fleet's default; several hosts give the server's address
        "--host",
        help="the address nats-server listens on (also in its certificate)",
    ),
    port: int = typer.Option(4222, "--port", min=1, max=65535, help="the port nats-server listens on"),
    server_name: list[str] = typer.Option(
        [], "--server-name", help="another DNS name or IP for the server certificate"
    ),
    json_out: bool = JsonOption,
) -> None:
    """Make a secure fleet: a CA, the server's certificate, nats.conf (mutual TLS, nkey users with per-role
    permissions) and the operator's credentials. Start the server with `nats-server -c DIR/nats.conf`."""
    fleet = FleetDir(directory)
    creds = _run(lambda: fleet.init(host=host, port=port, server_names=tuple(server_name)))
    if json_out:
        print_json({"config": str(fleet.config), "operator": str(creds)})
        return
    # each command on a line of its own, never wrapped (the console soft-wraps): it pastes as it is
    console.print(f"fleet in {fleet.root}; start its server with:", markup=False, highlight=False)
    console.print(f"  nats-server -c {shlex.quote(str(fleet.config))}", markup=False, highlight=False)
    console.print("and act as its operator with:", markup=False, highlight=False)
    console.print(f"  export FAUXMAD_CREDS={shlex.quote(str(creds))}", markup=False, highlight=False)


def add_worker(
    worker_id: str = typer.Argument(..., help="the worker's id (as `fauxmad worker --worker-id`)"),
    region: str = typer.Option(..., "--region", "-r", help="the worker's region: it answers that region's offers only"),
    address: list[str] = typer.Option(
        [], "--address", help="an IP address of the worker's host (its --advertise), named in its certificate (repeat)"
    ),
    directory: str = DIR_OPTION,
) -> None:
    """Credentials for one worker: it may answer only its own subjects and its region's offers."""
    import ipaddress

    for one in address:
        try:
            ipaddress.ip_address(one)
        except ValueError:
            fail(f"--address {one!r}: not an IP address", EXIT_USAGE)
    fleet = FleetDir(directory)
    _done(fleet, _run(lambda: fleet.add_worker(worker_id, region, tuple(address))))


def add_user(
    name: str = typer.Argument(..., help="a name for the identity (its inbox prefix too)"),
    role: str = typer.Option(..., "--role", help=f"one of {USER_ROLES}"),
    app: str | None = typer.Option(None, "--app", "-a", help="the app a deployer may deploy"),
    directory: str = DIR_OPTION,
) -> None:
    """Credentials for a person or a service: operator, broker, api (`fauxmad api`), proxy (`fauxmad proxy`), deployer
    (of one app) or viewer."""
    if role not in ROLES or role == "worker":
        fail(
            f"unknown role {role!r}: use one of {USER_ROLES} (workers: fleet add-worker)",
            EXIT_USAGE,
        )
    fleet = FleetDir(directory)
    _done(fleet, _run(lambda: fleet.add_user(name, role, app)))  # `role in ROLES` above narrows it to a Role


def revoke(name: str = typer.Argument(..., help="the identity to cut off"), directory: str = DIR_OPTION) -> None:
    """Take an identity out of the server's users and delete its credentials (a running server is reloaded)."""
    fleet = FleetDir(directory)
    _run(lambda: fleet.remove(name))
    reloaded = fleet.reload()
    console.print(f"{name} revoked" + ("" if reloaded else " (no running server here: takes effect at its start)"))


def rotate(
    names: list[str] | None = typer.Argument(None, help="identities to rotate (default: the server and everyone)"),
    directory: str = DIR_OPTION,
) -> None:
    """New TLS certificates from the same CA, then a reload: no connection drops (docs/how-to/secure-fleet.md)."""
    fleet = FleetDir(directory)
    rotated = _run(lambda: fleet.rotate(names or None))
    reloaded = fleet.reload()
    note = "" if reloaded else " (no running server here: it serves them at its start)"
    console.print(f"new certificates for {', '.join(rotated)}{note}", markup=False)


def reload(directory: str = DIR_OPTION) -> None:
    """Make the fleet's running nats-server re-read its users (SIGHUP; connections stay)."""
    if not FleetDir(directory).reload():
        fail(f"no running nats-server for {directory} (its pid file is missing or stale)")
    console.print("nats-server reloaded")


def prepare(
    nats: str | None = NatsOption,
    regions: str | None = typer.Option(
        None,
        "--regions",
        help="also the background jobs' work queue of each region (comma-separated)",
        callback=check_regions,
    ),
) -> None:
    """Create the fleet's streams and buckets. Every process does this at start on an open fleet; in a
    secure one only the operator may create them (the others bind), so run this once with its credentials."""

    async def ensure(nc: Nats) -> None:
        for region in split_names("region", regions or ""):
            await ensure_jobs_resources(nc.jetstream(), region)
        await ensure_fleet_resources(nc.jetstream(), every_region=True)
        await secrets_bucket(nc.jetstream())
        await ensure_audit_stream(nc.jetstream())
        await revoked_tokens_bucket(nc.jetstream())
        await Images.open(nc.jetstream())  # the images store and its tags bucket
        # volumes (docs/tutorials/images-and-volumes.md): snapshots and the routing index
        await snapshot_store(nc.jetstream())
        await volumes_bucket(nc.jetstream())

    with_connected(nats, lambda url: connect(url, "fauxmad-prepare"), ensure)
    console.print("the fleet's streams and buckets are in place")


def _done(fleet: FleetDir, creds: object) -> None:
    reloaded = fleet.reload()
    note = "" if reloaded else " (start or reload the server to let it in)"
    console.print(f"credentials: {creds}{note}", markup=False)


T = TypeVar("T")


def _run(action: Callable[[], T]) -> T:
    """`action()`, or one line and the right exit code when the fleet directory says no."""
    try:
        return action()
    except (FleetDirError, ValueError, BadRequest) as exc:
        fail(str(getattr(exc, "message", exc)), EXIT_USAGE)
    except OSError as exc:
        fail(f"{exc.filename or ''}: {exc.strerror or exc}".strip(": "))
