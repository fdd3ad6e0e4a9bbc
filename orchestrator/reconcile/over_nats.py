"""The reconciler's ports over NATS: where nats-py stops.

`NatsBus` is `bus.transport.service.call` on one connection (which already turns error replies and silence into
`FauxmadError`s). The release store over NATS is the app model's (`orchestrator.apps.store.KVReleaseStore`).
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from bus.transport.nats_adapter import Nats
from bus.transport.service import call

R = TypeVar("R")


class NatsBus:
    """`Bus` over one NATS connection."""

    def __init__(self, nc: Nats) -> None:
        self.nc = nc

    async def call(self, subject: str, request: msgspec.Struct, reply: type[R], *, timeout: float) -> R:
        return await call(self.nc, subject, request, reply, timeout=timeout)
