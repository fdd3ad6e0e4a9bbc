"""`fauxmad secrets set|list|unset -a APP`: thin; the work is in `orchestrator.secrets`."""

from __future__ import annotations

import typer

from bus.stores.secrets import secrets_bucket
from bus.transport.connection import connect
from bus.transport.nats_adapter import Nats
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, check_app, with_connected
from orchestrator.client import FleetClient
from orchestrator.secrets import SecretInfo, list_secrets, parse_pairs, rolling_restart, set_secrets, unset_secrets

secrets_app = typer.Typer(
    help="An app's secrets: sealed for the workers, given to its machines as environment variables.",
    no_args_is_help=True,
)
AppOption = typer.Option(..., "--app", "-a", help="the app", callback=check_app)
StageOption = typer.Option(False, "--stage", help="store only: machines get the change at their next start")


def _say(line: str) -> None:
    console.print(line, markup=False, highlight=False)


@secrets_app.command("set")
def set_command(
    pairs: list[str] = typer.Argument(..., help="NAME=VALUE, one or more"),
    app: str = AppOption,
    stage: bool = StageOption,
    nats: str | None = NatsOption,
) -> None:
    """Set secrets (sealed: only workers can open them), then restart the app's machines one at a time.

    `fauxmad secrets set -a web DATABASE_URL=postgres://... API_KEY=abc`
    """
    values = parse_pairs(pairs)

    async def act(nc: Nats) -> None:
        await set_secrets(await secrets_bucket(nc.jetstream()), app, values)
        _say(f"set {', '.join(sorted(values))} for {app}")
        if not stage:
            await _roll(nc, app)

    with_connected(nats, lambda url: connect(url, "fauxmad-secrets"), act)


@secrets_app.command("unset")
def unset_command(
    names: list[str] = typer.Argument(..., help="the names to remove"),
    app: str = AppOption,
    stage: bool = StageOption,
    nats: str | None = NatsOption,
) -> None:
    """Remove secrets, then restart the app's machines one at a time (unless --stage)."""

    async def act(nc: Nats) -> None:
        missing = await unset_secrets(await secrets_bucket(nc.jetstream()), app, names)
        removed = [name for name in names if name not in missing]
        _say(f"removed {', '.join(removed) or 'nothing'}" + (f" (not set: {', '.join(missing)})" if missing else ""))
        if removed and not stage:
            await _roll(nc, app)

    with_connected(nats, lambda url: connect(url, "fauxmad-secrets"), act)


@secrets_app.command("list")
def list_command(app: str = AppOption, nats: str | None = NatsOption, json_out: bool = JsonOption) -> None:
    """The app's secret names and versions (never their values)."""

    async def act(nc: Nats) -> list[SecretInfo]:
        return await list_secrets(await secrets_bucket(nc.jetstream()), app)

    infos = with_connected(nats, lambda url: connect(url, "fauxmad-secrets"), act)
    if json_out:
        print_json(infos)
        return
    if not infos:
        _say(f"{app} has no secrets")
    for info in infos:
        _say(f"{info.name:<32} v{info.version}")


async def _roll(nc: Nats, app: str) -> None:
    client = FleetClient(nc)
    restarted = await rolling_restart(client, app, _say)
    _say(f"{restarted} machine(s) of {app} restarted with the new secrets")
