"""What the reconciler needs of the world, and nothing more: the bus, the brokers' API, the KV and the clock.

Each need is a small Protocol (the release store's is the app model's, `orchestrator.apps.store`), so the loop
(`observe`, `executor`, `releases`, `reconciler`) is written against the shape of what it calls, not against
NATS: the edges in `over_nats` (and `orchestrator.apps.store` for releases) satisfy them in
production (and `FleetClient` satisfies `MachinesApi` as it is), an in-memory fleet satisfies them in
unit tests, and time is a function passed in, so a deadline is tested by moving the clock, not by
waiting for it. Errors cross these seams as `FauxmadError`s and plain values only: no NATS `Msg`, no
nats-py exception reaches the core.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Machine
from orchestrator.apps.store import ReleaseStore

__all__ = ["Bus", "Clock", "MachinesApi", "ReleaseStore"]

R = TypeVar("R")

Clock = Callable[[], float]
"""Seconds: `time.time` for when things happened (releases, health deadlines), `time.perf_counter` for
how long a loop has run."""


class Bus(Protocol):
    """One request to one subject, one typed reply: what the reconciler says to workers directly (list their
    machines, lease one, start, stop, update, destroy, cordon). A contract error arrives as the
    `FauxmadError` it stands for; nobody answering is `Unreachable`, no answer in time `Unanswered`."""

    async def call(self, subject: str, request: msgspec.Struct, reply: type[R], *, timeout: float) -> R: ...


class MachinesApi(Protocol):
    """The brokers' machines API, as far as the reconciler uses it: creates go through an auction, and a drain
    copies a machine no release manages. `FleetClient` satisfies it."""

    async def create(self, app: str, req: CreateRequest) -> Machine: ...

    async def get(self, app: str, machine_id: str, *, events: bool = True) -> Machine: ...

    async def destroy(self, app: str, machine_id: str, *, force: bool = False) -> Machine: ...
