"""`fauxmad fleet layout` and `fauxmad fleet replicas N`: the fleet's layout, which lives in the fleet.

Why commands: the layout (regions, home region, replicas) is a property of the fleet, kept in KV
`fauxmad_layout` (`bus.transport.fleet_layout`), not of each process's environment. So it is shown, set on an
empty fleet, and changed (a region added, a move from R1 to R3 after servers were added) by one command each,
and every process follows it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer

from bus.contract.errors import Unreachable
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
from bus.transport.jetstream import WORKER_TTL
from bus.transport.layout import Layout
from bus.transport.nats_adapter import Nats
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, fail, split_names, warn, with_client, with_connected

if TYPE_CHECKING:
    from orchestrator.client import FleetClient

# How long `fleet replicas` waits, after the move, for the workers live before it to beat again: a move makes
# the workers bucket unwritable for a few seconds (a heartbeat put then fails after its own 5 s), and the
# brokers' registries drop a worker silent for a TTL; five TTLs cover a failed beat and the next.
HEARD_AGAIN_WITHIN = 5 * WORKER_TTL


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
    """Move every bucket and stream of the fleet to COUNT replicas in place (after servers were added: 3).

    It returns once the workers live before the move beat again and the brokers list them (at most 15 s), so
    the next command finds the fleet whole."""

    async def go(client: FleetClient) -> tuple[list[str], list[str], float]:
        before = await live_workers(client)
        changed = await set_replicas(client.nc.jetstream(), count)
        started = time.perf_counter()
        silent = await heard_again(client, before, within=HEARD_AGAIN_WITHIN) if changed and before else []
        return changed, silent, time.perf_counter() - started

    changed, silent, waited = with_client(nats, go, name="fauxmad-replicas")
    console.print(
        f"the fleet's layout is R{count}; {len(changed)} streams and buckets moved"
        + (f": {', '.join(changed)}" if changed else ""),
        markup=False,
    )
    if silent:
        warn(
            [
                f"{len(silent)} worker(s) not heard within {HEARD_AGAIN_WITHIN:g}s of the move: {', '.join(silent)}"
                " (`fauxmad workers` lists the live ones)"
            ]
        )
    elif changed and waited >= 1.0:
        console.print(f"every worker beat again {waited:.1f}s after the move", markup=False)


async def live_workers(client: FleetClient) -> dict[str, float] | None:
    """The live workers as the brokers list them (id: its last heartbeat's stamp), or None without a broker."""
    try:
        return {w.worker_id: w.heartbeat_at for w in await client.workers()}
    except Unreachable:
        return None


async def heard_again(
    client: FleetClient,
    before: dict[str, float],
    *,
    within: float,
    clock: Callable[[], float] = time.perf_counter,
    every: float = 0.2,
) -> list[str]:
    """Wait until each worker of `before` is listed with a heartbeat newer than the one listed when the wait
    began (one the brokers received after the move); returns those still not heard after `within` seconds."""
    deadline = clock() + within
    first = await live_workers(client) or {}
    waiting = set(before)
    while True:
        now = await live_workers(client) or {}
        waiting = {w for w in waiting if not (w in now and now[w] > first.get(w, 0.0))}
        if not waiting or clock() >= deadline:
            return sorted(waiting)
        await asyncio.sleep(every)
