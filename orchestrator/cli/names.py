"""Names a user typed, looked up in the fleet: one answer for an unknown app, machine or region on every command.

docs/reference/exit-codes.md, "Unknown names": an app, machine or region the fleet does not know is exit 4 on
every command, one line, with the closest names suggested (`sandwhich`: did you mean 'sandwich'?), as git
and kubectl do; an unknown region lists the regions there are. Region names ignore case (`runtime` folds
them). A machine id may be a unique prefix (`machine show 426a4e3d`), as git and docker accept; an
ambiguous one is exit 2, listing the matches.

The names given on the command line are recorded by their typer callbacks (`runtime._names`), so the one
edge that reports errors (`app.report`) can say which of them the fleet does not know, whichever command
failed; it asks the fleet only then, on the error's path.
"""

from __future__ import annotations

import asyncio
import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from orchestrator.cli.runtime import EXIT_NOT_FOUND, EXIT_USAGE, CliError, given, with_client

if TYPE_CHECKING:
    from orchestrator.client import FleetClient
    from orchestrator.reconcile.reconciler import Reconciler

MACHINE_ID_LENGTH = 14


class Unknown(CliError):
    """A name the fleet does not know, said already with the closest ones (exit 4), or an ambiguous prefix (2)."""


LOOKUP_TIMEOUT = 5.0  # seconds for the names of the fleet, on an error's path


def closest(name: str, choices: Iterable[str]) -> list[str]:
    """The names in `choices` closest to `name` (at most 3, best first; case ignored)."""
    by_folded = {choice.lower(): choice for choice in choices}
    return [by_folded[m] for m in difflib.get_close_matches(name.lower(), list(by_folded), n=3, cutoff=0.6)]


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    near = closest(name, choices)
    return f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""


async def app_names(client: FleetClient) -> set[str]:
    """Every app the fleet knows: with machines on a live worker, with releases, or with a record (the API's)."""
    from bus.contract.subjects import APPS_BUCKET
    from bus.stores.kv_keys import kv_keys
    from orchestrator.apps.releases import Releases
    from orchestrator.apps.store import KVReleaseStore

    names = {app for worker in await client.workers() for app, count in worker.app_machines.items() if count}
    store = KVReleaseStore(await client.nc.jetstream().key_value(APPS_BUCKET))
    names.update(await Releases(store).apps())
    names.update(key.partition(".")[0] for key in await kv_keys(store.kv, "*.record"))
    return names


async def region_names(client: FleetClient) -> list[str]:
    """The regions with a live worker."""
    return sorted({worker.region for worker in await client.workers()})


async def require_app(client: FleetClient, app: str) -> None:
    """Nothing if the fleet knows `app` (or it has machines, destroyed ones included), else exit 4 with a hint."""
    if app in await app_names(client) or await client.list(app, include_destroyed=True):
        return
    raise unknown_app(app, await app_names(client))


def unknown_app(app: str, names: Iterable[str]) -> CliError:
    hint = did_you_mean(app, names) or " (`fauxmad apps list` lists them)"
    return Unknown(f"no app {app!r}{hint}", EXIT_NOT_FOUND)


async def require_regions(client: FleetClient, regions: Iterable[str]) -> None:
    """Nothing if every region has a live worker, else exit 4 naming the first that has none and the regions
    there are."""
    known = await region_names(client)
    for region in regions:
        if region not in known:
            raise unknown_region(region, known)


def unknown_region(region: str, known: list[str]) -> CliError:
    there = ", ".join(known) or "none: no live workers"
    return Unknown(f"no region {region!r}{did_you_mean(region, known)}: the regions are {there}", EXIT_NOT_FOUND)


async def resolve_machine(client: FleetClient, app: str, machine_id: str) -> str:
    """The machine of `app` whose id is `machine_id` or starts with it; exit 4 for none, 2 for several."""
    if len(machine_id) == MACHINE_ID_LENGTH or not all(c in "0123456789abcdef" for c in machine_id.lower()):
        return machine_id  # whole, or no id at all (the fleet says what an id is)
    ids = [m.id for m in await client.list(app, include_destroyed=True)]
    matches = [i for i in ids if i.startswith(machine_id.lower())]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        if not ids:
            await require_app(client, app)
        raise Unknown(f"machine {machine_id} not found in app {app}{did_you_mean(machine_id, ids)}", EXIT_NOT_FOUND)
    raise Unknown(
        f"machine id {machine_id!r} is ambiguous in app {app}: it starts {', '.join(sorted(matches))}", EXIT_USAGE
    )


def explained(message: str) -> str:
    """`message` of a not-found error, said as the names given on the command line make it: the app, the
    machine or the region the fleet does not know, with the closest names. `message` if none of them is
    unknown, or the fleet cannot be asked."""
    names = given()
    if not names.keys() - {"nats"} or message.startswith("job "):  # jobs have their own ids and apps
        return message

    async def look(client: FleetClient) -> str:
        app = names.get("app")
        if app is not None:
            apps = await app_names(client)
            if app not in apps and not await client.list(app, include_destroyed=True):
                return str(unknown_app(app, apps))
        machine = names.get("machine id")
        if machine is not None and app is not None:
            ids = [m.id for m in await client.list(app, include_destroyed=True)]
            if machine not in ids:
                return f"{message}{did_you_mean(machine, ids)}"
        return message

    async def bounded(client: FleetClient) -> str:
        return await asyncio.wait_for(look(client), LOOKUP_TIMEOUT)

    try:
        return with_client(names.get("nats"), bounded, name="fauxmad-names")
    except Exception:  # the original message is still true
        return message


def client_of(reconciler: Reconciler) -> FleetClient:
    """The fleet client a reconciler of the CLI's (`Reconciler.connect`) holds."""
    from orchestrator.client import FleetClient

    client = reconciler.machines
    assert isinstance(client, FleetClient)
    return client
