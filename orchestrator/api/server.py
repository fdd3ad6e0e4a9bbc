"""The aiohttp application: Fly's `/v1` paths, each one request on the brokers' subjects.

Bodies are decoded with the strict Structs of `orchestrator.api.types`; every failure a client causes is a
4xx with Fly's error body (a middleware turns aiohttp's own errors, such as 413, into that body too).

A create, start, restart or update whose machine could not start (its process never spawned: the image's
pull refused, a volume not mounted) is not a success: a 422 whose error is the machine's reason, with its
`machine_id` (the machine is kept, `failed`, for a look at its events and a later start or destroy). Not a
5xx: nothing in the API broke, and retrying the same request cannot help; not a 200 as Fly's create gives
for a machine that starts and then exits, since this one never ran. A process that starts and then exits
is reported as before, by `wait` and the machine's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, get_args

from aiohttp import web

from bus.contract import subjects
from bus.contract.base import State, seconds
from bus.contract.deadlines import caller_wait
from bus.contract.errors import FauxmadError
from bus.contract.fleet import CreateRequest
from bus.contract.machines import (
    STOP_TIMEOUT_MAX,
    DestroyRequest,
    GetRequest,
    Lease,
    LeaseRequest,
    ListRequest,
    Machine,
    ReleaseRequest,
    SignalRequest,
    StartRequest,
    StopRequest,
    UpdateRequest,
    WaitRequest,
)
from bus.transport.audit import AuditTrail
from bus.transport.nats_adapter import Nats
from orchestrator.api import apps, metadata, metrics, placements, types, volumes
from orchestrator.api.auth import TRAIL, Auth, guard
from orchestrator.api.errors import error_response, from_bus
from orchestrator.api.http import (
    BROKERS,
    MAX_BODY,
    NC,
    Answering,
    Brokers,
    ClientError,
    app_name,
    ask,
    body,
    flag,
    json,
    machine_id,
    nonce,
)
from orchestrator.api.images import IMAGES, ImageDoor, machine_config
from orchestrator.api.openapi import DOCS_HTML, document
from orchestrator.restart import restart_lease

T = TypeVar("T")

WAIT_MAX = 60.0
WAIT_STATES = frozenset({"created", "started", "stopped", "destroyed", "failed"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------------------------------------------
# handlers


STATES: frozenset[str] = frozenset(get_args(State))


async def list_machines(request: web.Request) -> web.Response:
    """Fly's filters: `region`, `include_deleted` (destroyed machines too), and the newer `state` (one or
    several, comma-separated or repeated) and `summary` (no config or events)."""
    states = [s for value in request.query.getall("state", []) for s in value.split(",") if s]
    for state in states:
        if state not in STATES:
            raise ClientError(400, f"invalid state {state!r}: use one of {', '.join(sorted(STATES))}")
    region = request.query.get("region") or None
    include_deleted = _bool(request, "include_deleted")
    include_deleted = include_deleted or "destroyed" in states
    wanted = ListRequest(state=states[0] if len(states) == 1 else None, include_destroyed=include_deleted)  # type: ignore[arg-type]
    found = await request.app[BROKERS].call(
        subjects.api_machines(app_name(request), "list"), wanted, list[Machine], timeout=caller_wait("list")
    )
    if region is not None:
        found = [m for m in found if m.region == region]
    if states:
        found = [m for m in found if m.state in states]
    summary = _bool(request, "summary")
    return json([types.machine(m, summary=summary) for m in found])


def _bool(request: web.Request, name: str) -> bool:
    """A boolean query parameter as Go's strconv.ParseBool reads it (Fly's server); anything else is a 400."""
    value = request.query.get(name)
    if value is None or value == "":
        return False
    if value.lower() in ("1", "t", "true"):
        return True
    if value.lower() in ("0", "f", "false"):
        return False
    raise ClientError(400, f"{name} must be true or false, not {value!r}")


async def started(request: web.Request, machine: Machine) -> Machine:
    """`machine` (a start's answer), or a 422 with its reason when its start failed (see the module docstring).
    A `failed` machine whose newest event is not that failure (an update of a machine that was failed and is
    not started again) is answered as it is."""
    if machine.state != "failed":
        return machine
    got = await ask(request, "get", GetRequest(id=machine.id, events=True))
    events = got.events if isinstance(got.events, list) else []
    newest = max(events, key=lambda e: (e.timestamp, e.seq), default=None)
    if newest is None or newest.status != "failed" or newest.type != "transition":
        return machine
    reason = newest.reason or "no reason recorded"
    raise ClientError(422, f"machine {machine.id} failed to start: {reason}", machine_id=machine.id)


async def create_machine(request: web.Request) -> web.Response:
    req = await body(request, types.CreateMachineRequest)
    config = await machine_config(request, req.config)
    create = CreateRequest(region=req.region, config=config, name=req.name, skip_launch=req.skip_launch)
    return json(types.machine(await started(request, await ask(request, "create", create))))


async def get_machine(request: web.Request) -> web.Response:
    got = await ask(request, "get", GetRequest(id=machine_id(request), events=True))
    return json(types.machine(got))


async def update_machine(request: web.Request) -> web.Response:
    mid = machine_id(request)
    req = await body(request, types.UpdateMachineRequest)
    config = await machine_config(request, req.config)
    update = UpdateRequest(id=mid, config=config, lease_nonce=nonce(request))
    return json(types.machine(await started(request, await ask(request, "update", update))))


async def delete_machine(request: web.Request) -> web.Response:
    force = flag(request, "force") or flag(request, "kill")
    await ask(request, "destroy", DestroyRequest(id=machine_id(request), force=force, lease_nonce=nonce(request)))
    return json({"ok": True})


async def start_machine(request: web.Request) -> web.Response:
    start = StartRequest(id=machine_id(request), lease_nonce=nonce(request))
    await started(request, await ask(request, "start", start))
    return json({"previous_state": "", "migrated": False, "new_host": ""})


async def stop_machine(request: web.Request) -> web.Response:
    mid = machine_id(request)
    req = await body(request, types.StopRequest)
    try:
        timeout = min(seconds(req.timeout), STOP_TIMEOUT_MAX)  # "9000h" waits a day at most
    except ValueError as exc:
        raise ClientError(400, str(exc)) from None
    stop = StopRequest(id=mid, signal=req.signal, timeout=timeout, lease_nonce=nonce(request))
    await ask(request, "stop", stop, own_timeout=timeout)
    return json({"ok": True})


async def restart_machine(request: web.Request) -> web.Response:
    """Stop (SIGTERM, then SIGKILL after `?timeout=`: seconds or a Go duration, default 10 s), then start, under
    the caller's lease or one of the restart's own."""
    mid = machine_id(request)
    given = request.query.get("timeout") or "10"
    try:
        timeout = min(seconds(float(given) if given.replace(".", "", 1).isdigit() else given), STOP_TIMEOUT_MAX)
    except ValueError as exc:
        raise ClientError(400, f"timeout: {exc}") from None

    def brokers(verb: str, payload: Any, into: type[T]) -> Awaitable[T]:
        subject = subjects.api_machines(app_name(request), verb)
        return request.app[BROKERS].call(subject, payload, into, timeout=caller_wait(verb))

    holder = "a restart through the API"
    async with restart_lease(brokers, mid, timeout, holder=holder, given=nonce(request)) as lease_nonce:
        stop = StopRequest(id=mid, timeout=timeout, lease_nonce=lease_nonce)
        await ask(request, "stop", stop, own_timeout=timeout)
        await started(request, await ask(request, "start", StartRequest(id=mid, lease_nonce=lease_nonce)))
    return json({"ok": True})


async def signal_machine(request: web.Request) -> web.Response:
    mid = machine_id(request)
    req = await body(request, types.SignalRequest)
    await ask(request, "signal", SignalRequest(id=mid, signal=req.signal, lease_nonce=nonce(request)))
    return json({"ok": True})


def _wait_args(request: web.Request) -> tuple[list[str], float]:
    states = request.query.getall("state", ["started"])
    allowed = WAIT_STATES
    for state in states:
        if state not in allowed:
            raise ClientError(400, f"invalid state {state!r}: use one of {sorted(allowed)}")
    try:
        timeout = float(request.query.get("timeout", "60"))
    except ValueError:
        raise ClientError(400, "timeout must be a number of seconds") from None
    if not 0 <= timeout <= WAIT_MAX:
        raise ClientError(400, f"timeout must be between 0 and {WAIT_MAX:g} seconds")
    return states, timeout


async def wait_machine(request: web.Request) -> web.Response:
    states, timeout = _wait_args(request)
    mid = machine_id(request)
    waits = [
        asyncio.ensure_future(ask(request, "wait", WaitRequest(id=mid, state=s, timeout=timeout), own_timeout=timeout))  # type: ignore[arg-type]
        for s in states
    ]
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        reached = done.pop().result()
    finally:
        for task in waits:
            task.cancel()
    instance = request.query.get("instance_id")
    if instance and reached.instance_id != instance:
        raise ClientError(412, f"machine {mid} now runs instance {reached.instance_id}, not {instance}")
    return json({"ok": True, "state": reached.state})


async def machine_events(request: web.Request) -> web.Response:
    got = await ask(request, "get", GetRequest(id=machine_id(request), events=True))
    return json(types.machine(got).events)


async def get_lease(request: web.Request) -> web.Response:
    got = await ask(request, "get", GetRequest(id=machine_id(request), events=False))
    if got.lease is None:
        raise ClientError(404, "no lease")
    return json(_lease(got.lease))


def _lease(lease: Lease) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {"nonce": lease.nonce, "owner": lease.holder, "expires_at": int(lease.expires_at)},
    }


async def acquire_lease(request: web.Request) -> web.Response:
    mid = machine_id(request)
    req = await body(request, types.LeaseRequest)
    lease = LeaseRequest(id=mid, ttl=req.ttl, holder=req.description, nonce=nonce(request))
    subject = subjects.api_machines(app_name(request), "lease")
    held = await request.app[BROKERS].call(subject, lease, Lease, timeout=caller_wait("lease"))
    return json(_lease(held))


async def release_lease(request: web.Request) -> web.Response:
    mid = machine_id(request)
    given = nonce(request)
    if given is None:
        raise ClientError(400, "releasing a lease needs its nonce in the fly-machine-lease-nonce header")
    subject = subjects.api_machines(app_name(request), "release")
    await request.app[BROKERS].call(
        subject, ReleaseRequest(id=mid, nonce=given), dict[str, Any], timeout=caller_wait("release")
    )
    return json({"ok": True})


# Fly's operations fauxmad does not do: a 501 naming what to use instead, never a success for nothing done
NOT_SUPPORTED = {
    ("POST", "/exec"): "POST .../exec is not supported here: use `fauxmad machine exec ID -a APP -- CMD`",
    ("GET", "/ps"): "GET .../ps is not supported: fauxmad keeps no process list of a machine",
    ("GET", "/versions"): "GET .../versions is not supported: fauxmad keeps no config versions of a machine",
}


def _not_supported(message: str) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        raise ClientError(501, message)

    return handler


async def openapi(request: web.Request) -> web.Response:
    return json(document())


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=DOCS_HTML, content_type="text/html")


# ---------------------------------------------------------------------------------------------------
# the application


def _errors() -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ClientError as exc:
            return error_response(exc.status, exc.message, machine_id=exc.machine_id)
        except FauxmadError as exc:
            return from_bus(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(exc.status, exc.reason)

    return middleware


def build(nc: Nats, *, auth: Auth | None = None, broker: Answering | None = None) -> web.Application:
    """The application; `auth` says what a `/v1` request must carry (default: nothing, an open API); `broker`
    answers the API's requests in this process (default: the brokers, over NATS)."""
    trail = AuditTrail(nc)
    middlewares = [metrics.measure, guard(auth or Auth(), trail), _errors()]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
    app.on_cleanup.append(lambda _: trail.drain())
    app[NC] = nc
    app[TRAIL] = trail
    app[BROKERS] = Brokers(nc, broker)
    app[IMAGES] = ImageDoor(nc)
    m = "/v1/apps/{app_name}/machines"
    one = m + "/{machine_id}"
    app.router.add_get(m, list_machines)
    app.router.add_post(m, create_machine)
    app.router.add_get(one, get_machine)
    app.router.add_post(one, update_machine)
    app.router.add_delete(one, delete_machine)
    app.router.add_post(one + "/start", start_machine)
    app.router.add_post(one + "/stop", stop_machine)
    app.router.add_post(one + "/restart", restart_machine)
    app.router.add_post(one + "/signal", signal_machine)
    app.router.add_get(one + "/wait", wait_machine)
    app.router.add_get(one + "/events", machine_events)
    app.router.add_get(one + "/lease", get_lease)
    app.router.add_post(one + "/lease", acquire_lease)
    app.router.add_delete(one + "/lease", release_lease)
    for (method, tail), message in NOT_SUPPORTED.items():
        app.router.add_route(method, one + tail, _not_supported(message))
    app.router.add_post(
        "/v1/apps/{app_name}/volumes/{volume_id}",
        _not_supported("POST .../volumes/{id} (update) is not supported: a volume's size changes with PUT .../extend"),
    )
    apps.add_routes(app)
    metadata.add_routes(app, one)
    placements.add_routes(app)
    volumes.add_routes(app)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/docs", docs)
    return app
