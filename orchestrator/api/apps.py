"""`/v1/apps`: an app is a record made by `POST /v1/apps`, or the name its machines or its releases share.

Fly's clients create an app, then list it, get it and delete it, and expect each to mean what it says. fauxmad
has no app service, so `POST /v1/apps` writes a small record beside the app's releases, key `<app>.record` of
KV `fauxmad_apps` (a deployer of the app may write its keys already; the releases' readers ignore the key).
An app exists while it has a record, a release or a machine: `GET` answers 404 otherwise. `DELETE` does
what `fauxmad apps destroy` does, and answers only once it is done: the app's head is marked destroyed (an
operator converges it to nothing and brings no machine back), every machine is destroyed, then its record,
releases and head are purged, and the answer waits until the workers' heartbeats count none of its machines
(so a listing right after it does not show the app). Machine counts in a listing are the workers' heartbeats
(a second or so behind); one app's are its machines as the brokers list them.
"""

from __future__ import annotations

import asyncio
import builtins
import time

import msgspec
from aiohttp import web

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.deadlines import caller_wait
from bus.contract.fleet import WorkerInfo, WorkersListRequest
from bus.contract.machines import DestroyRequest, ListRequest, Machine
from bus.stores.kv_keys import kv_keys
from orchestrator.api import types
from orchestrator.api.http import BROKERS, NC, ClientError, app_name, body, json
from orchestrator.apps.releases import Releases
from orchestrator.apps.store import KVReleaseStore

DESTROY_PASSES = 3  # machines made while a delete runs are destroyed too, up to this many rounds
DESTROY_CONCURRENCY = 8
UNLISTED_WITHIN = 10.0  # seconds a delete waits for the heartbeats to stop counting the app's machines


def _record_key(name: str) -> str:
    return f"{name}.record"


async def _store(request: web.Request) -> KVReleaseStore:
    """KV `fauxmad_apps` (made by the API's embedded broker when it started)."""
    return KVReleaseStore(await request.app[NC].jetstream().key_value(subjects.APPS_BUCKET))


async def _record(store: KVReleaseStore, name: str) -> types.AppRecord | None:
    raw = await store.get(_record_key(name))
    if raw is None:
        return None
    try:
        return decode(types.AppRecord, raw)
    except msgspec.DecodeError:  # not ours to fail on: the name still has a record
        return types.AppRecord(name=name)


async def _counts(request: web.Request) -> dict[str, int]:
    workers = await request.app[BROKERS].call(
        subjects.API_WORKERS_LIST, WorkersListRequest(), builtins.list[WorkerInfo], timeout=10
    )
    counts: dict[str, int] = {}
    for worker in workers:
        for name, n in worker.app_machines.items():
            counts[name] = counts.get(name, 0) + n
    return counts


async def _machines(request: web.Request, name: str) -> builtins.list[Machine]:
    subject = subjects.api_machines(name, "list")
    return await request.app[BROKERS].call(subject, ListRequest(), builtins.list[Machine], timeout=caller_wait("list"))


def _status(count: int) -> str:
    return "deployed" if count else "pending"


async def list_apps(request: web.Request) -> web.Response:
    """Apps with a record of `org_slug` (those with no record, made by machines or deploys, are `personal`'s);
    no `org_slug`: every org's."""
    org = request.query.get("org_slug") or None
    store = await _store(request)
    counts = await _counts(request)
    records: dict[str, types.AppRecord] = {}
    for key in await kv_keys(store.kv, "*.record"):
        name = key.partition(".")[0]
        records[name] = await _record(store, name) or types.AppRecord(name=name)
    names = set(records) | {n for n, c in counts.items() if c} | set(await Releases(store).apps())
    apps = []
    for name in sorted(names):
        record = records.get(name)
        if org is not None and (record.org_slug if record else "personal") != org:
            continue
        count = counts.get(name, 0)
        network = record.network if record else ""
        apps.append(types.ListApp(id=name, name=name, machine_count=count, network=network, status=_status(count)))
    return json(types.ListAppsResponse(total_apps=len(apps), apps=apps))


async def create_app(request: web.Request) -> web.Response:
    req = await body(request, types.CreateAppRequest)
    name = subjects.check_token("app", req.app_name)  # the body's pattern says as much: a 400 either way
    record = types.AppRecord(name=name, org_slug=req.org_slug, network=req.network or "", created_at=time.time())
    if not await (await _store(request)).create(_record_key(name), encode(record)):
        raise ClientError(409, f"app {name} already exists")
    return json(_app(record, 0), status=201)


def _app(record: types.AppRecord, count: int) -> types.App:
    org = types.Organization(name=record.org_slug, slug=record.org_slug)
    return types.App(id=record.name, name=record.name, status=_status(count), organization=org, machine_count=count)


async def get_app(request: web.Request) -> web.Response:
    name = app_name(request)
    store = await _store(request)
    record = await _record(store, name)
    count = len(await _machines(request, name))
    if record is None and not count and name not in await Releases(store).apps():
        raise ClientError(404, f"app {name} not found")
    return json(_app(record or types.AppRecord(name=name), count))


async def delete_app(request: web.Request) -> web.Response:
    """Destroy every machine of the app, then forget it (module docstring); 202 once that is done."""
    name = app_name(request)
    store = await _store(request)
    releases = Releases(store)
    has_releases = name in await releases.apps()
    found = await _machines(request, name)
    if await _record(store, name) is None and not has_releases and not found:
        raise ClientError(404, f"app {name} not found")
    if has_releases:
        await releases.point(name, 0, destroyed=True)  # no operator brings a machine back
    limit = asyncio.Semaphore(DESTROY_CONCURRENCY)

    async def destroy(machine: Machine) -> None:
        async with limit:
            subject = subjects.api_machines(name, "destroy")
            forced = DestroyRequest(id=machine.id, force=True)
            await request.app[BROKERS].call(subject, forced, Machine, timeout=caller_wait("destroy"))

    for _ in range(DESTROY_PASSES):
        if not found:
            break
        await asyncio.gather(*(destroy(m) for m in found))
        found = await _machines(request, name)
    if found:
        left = ", ".join(m.id for m in found[:5])
        raise ClientError(409, f"app {name}: machines were still being made while it was destroyed ({left}); try again")
    await releases.purge(name)  # its releases, head and record
    await store.purge(_record_key(name))
    await _until_unlisted(request, name)
    return web.Response(status=202)


async def _until_unlisted(request: web.Request, name: str) -> None:
    """Wait until no worker's heartbeat counts a machine of `name`, so a listing right after the 202 does not show
    the app (its counts are the heartbeats', a beat behind the brokers'), for at most `UNLISTED_WITHIN` seconds:
    then the listing catches up by itself within a heartbeat."""
    give_up = time.perf_counter() + UNLISTED_WITHIN
    while (await _counts(request)).get(name) and time.perf_counter() < give_up:
        await asyncio.sleep(0.1)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/apps", list_apps)
    app.router.add_post("/v1/apps", create_app)
    app.router.add_get("/v1/apps/{app_name}", get_app)
    app.router.add_delete("/v1/apps/{app_name}", delete_app)
