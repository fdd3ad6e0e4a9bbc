"""`fauxmad fleet layout` and `fauxmad fleet replicas N`: the fleet's layout, which lives in the fleet.

Why commands: the layout (regions, home region, replicas) is a property of the fleet, kept in KV
`fauxmad_layout` (`bus.transport.fleet_layout`), not of each process's environment. So it is shown, set on an
empty fleet, and changed (a region added, a move from R1 to R3 after servers were added) by one command each,
and every process follows it.
"""

from __future__ import annotations

import typer

from bus.transport.connection import connect
from bus.transport.fleet_layout import (
    REPLICA_CHOICES,
    Told,
    describe,
    fleet_layout,
    read_layout,
    set_replicas,
    write_layout,
)
from bus.transport.layout import Layout
from bus.transport.nats_adapter import Nats
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, fail, split_names, with_connected


def register(fleet_app: typer.Typer) -> None:
    fleet_app.command("layout")(layout)
    fleet_app.command("replicas")(replicas)


def _check_replicas(value: int | None) -> int | None:
    if value is not None and value not in REPLICA_CHOICES:
        raise typer.BadParameter("must be 1, 3 or 5")
    return value


def layout(
    regions: str | None = typer.Option(
        None,
        "--regions",
        help="the supercluster's regions, home first (comma-separated): sets them on an empty fleet; on a fleet"
        " with a layout, only appends regions (a region added)",
    ),
    replicas_: int | None = typer.Option(
        None, "--replicas", help="1, 3 or 5 (default: what the servers offer)", callback=_check_replicas
    ),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """The fleet's layout (regions, home region, replicas), kept in the fleet; written first on an empty fleet."""
    wanted = tuple(split_names("region", regions)) if regions else None

    async def go(nc: Nats) -> Layout:
        js = nc.jetstream()
        stored = await read_layout(js)
        if stored is None:  # an empty fleet: what was given, the rest from what the servers offer
            return await fleet_layout(js, Told(regions=wanted, replicas=replicas_, source="the command line"))
        if wanted is not None and wanted != stored.regions:
            if wanted[: len(stored.regions)] != stored.regions:
                fail(
                    f"--regions {','.join(wanted)} does not keep the fleet's regions"
                    f" ({','.join(stored.regions) or 'none'}) first and in order: regions can only be added"
                )
            stored = await write_layout(js, Layout(regions=wanted, replicas=stored.replicas))
        if replicas_ is not None and replicas_ != stored.replicas:
            await set_replicas(js, replicas_)
            stored = Layout(regions=stored.regions, replicas=replicas_)
        return stored

    found = with_connected(nats, lambda url: connect(url, "fauxmad-layout"), go)
    if json_out:
        print_json({"regions": list(found.regions), "home": found.home, "replicas": found.replicas})
    else:
        console.print(f"the fleet's layout: {describe(found)}", markup=False)


def replicas(
    count: int = typer.Argument(..., help="1, 3 or 5", callback=_check_replicas),
    nats: str | None = NatsOption,
) -> None:
    """Move every bucket and stream of the fleet to COUNT replicas in place (after servers were added: 3)."""

    async def go(nc: Nats) -> list[str]:
        return await set_replicas(nc.jetstream(), count)

    changed = with_connected(nats, lambda url: connect(url, "fauxmad-replicas"), go)
    console.print(
        f"the fleet's layout is R{count}; {len(changed)} streams and buckets moved"
        + (f": {', '.join(changed)}" if changed else ""),
        markup=False,
    )
