"""Which method answers each verb of the worker's machines and volumes, in tables mypy checks.

A route pairs a verb's request type with the method that takes it: `route()` will not type-check when
the method takes another request, and a sync method is made awaitable with `now()`. The contract
(`bus.contract.verbs` WORKER_REQUESTS, WORKER_VOLUME_REQUESTS) lists the verbs and their payloads;
building a table checks it against the contract, so a verb without a method, a method for no verb, or a
request type that is not the contract's stops the worker at start, not at its first request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from bus.contract.base import Request
from bus.contract.machines import (
    DestroyRequest,
    ExecRequest,
    GetRequest,
    LeaseRequest,
    ListRequest,
    Machine,
    ReleaseRequest,
    ReserveRequest,
    ResumeRequest,
    SignalRequest,
    StartRequest,
    StopRequest,
    SuspendRequest,
    UpdateRequest,
    WaitRequest,
)
from bus.contract.verbs import WORKER_REQUESTS, WORKER_VOLUME_REQUESTS
from bus.contract.volumes import VolumeCreateRequest, VolumeExtendRequest, VolumeIdRequest, VolumeListRequest
from workers.lifecycle.manager import MachineManager
from workers.output import LogFollower
from workers.volumes.verbs import VolumeManager

R = TypeVar("R", bound=Request)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Route(Generic[R]):
    kind: type[R]  # the payload is decoded as this
    call: Callable[[R], Awaitable[object]]  # and answered by this


Routes = Mapping[str, Route[Any]]


def route(kind: type[R], call: Callable[[R], Awaitable[object]]) -> Route[Any]:
    """The one place a route is made: mypy checks here that `call` takes `kind`."""
    return Route(kind, call)


def now(method: Callable[[R], T]) -> Callable[[R], Awaitable[T]]:
    """A method that answers at once, as a route's awaitable call."""

    async def call(request: R) -> T:
        return method(request)

    return call


ROUTED_WITHIN = 0.5  # seconds a reserve's answer waits at most for its machine's index entry to be stored


def machine_routes(
    manager: MachineManager, follower: LogFollower, routed: Callable[[str], Awaitable[None]] | None = None
) -> Routes:
    """`worker.<id>.machines.<verb>`: the machine manager's method of that name.

    `routed(machine_id)`: resolved once the machine's routing index entry is stored. A reserve is answered
    after it (at most `ROUTED_WITHIN`; with JetStream away the answer goes anyway, as the commit is durable),
    so from the create's reply on every broker finds the machine, not only the one that placed it."""

    async def destroy(request: DestroyRequest) -> Machine:
        machine = await manager.destroy(request)
        follower.unfollow(machine.id)
        return machine

    async def reserve(request: ReserveRequest) -> Machine:
        machine = await manager.reserve(request)
        if routed is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(routed(machine.id), ROUTED_WITHIN)
        return machine

    return checked(
        "machines",
        {
            "reserve": route(ReserveRequest, reserve),
            "start": route(StartRequest, manager.start),
            "stop": route(StopRequest, manager.stop),
            "destroy": route(DestroyRequest, destroy),
            "get": route(GetRequest, now(manager.get)),
            "list": route(ListRequest, now(manager.list)),
            "wait": route(WaitRequest, manager.wait),
            "signal": route(SignalRequest, manager.signal),
            "lease": route(LeaseRequest, manager.lease),
            "release": route(ReleaseRequest, manager.release),
            "update": route(UpdateRequest, manager.update),
            "exec": route(ExecRequest, manager.exec),
            "suspend": route(SuspendRequest, manager.suspend),
            "resume": route(ResumeRequest, manager.resume),
        },
        WORKER_REQUESTS,
    )


def volume_routes(volumes: VolumeManager) -> Routes:
    """`worker.<id>.volumes.<verb>`: the volume manager's method of that name."""
    return checked(
        "volumes",
        {
            "create": route(VolumeCreateRequest, volumes.create),
            "list": route(VolumeListRequest, now(volumes.list)),
            "get": route(VolumeIdRequest, now(volumes.get)),
            "extend": route(VolumeExtendRequest, volumes.extend),
            "destroy": route(VolumeIdRequest, volumes.destroy),
            "snapshot": route(VolumeIdRequest, volumes.snapshot),
        },
        WORKER_VOLUME_REQUESTS,
    )


def checked(family: str, routes: dict[str, Route[Any]], contract: Mapping[str, type[Request]]) -> Routes:
    """`routes` if it answers exactly the contract's verbs with the contract's request types, else TypeError."""
    problems = [f"no route for {verb!r}" for verb in contract if verb not in routes]
    problems += [f"{verb!r} is not a verb of the contract" for verb in routes if verb not in contract]
    problems += [
        f"{verb!r} takes {routes[verb].kind.__name__}, the contract says {kind.__name__}"
        for verb, kind in contract.items()
        if verb in routes and routes[verb].kind is not kind
    ]
    if problems:
        raise TypeError(f"worker {family} routes disagree with the contract: {'; '.join(problems)}")
    return routes
