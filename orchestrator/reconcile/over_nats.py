"""The reconciler's ports over NATS: where nats-py stops.

`NatsBus` is `bus.transport.service.call` on one connection (which already turns error replies and silence into
`FauxmadError`s). `KVReleaseStore` is a JetStream KV bucket with nats-py's "no such key" and "key exists"
exceptions turned into the plain answers `ReleaseStore` promises, so `releases` never sees them.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from bus.stores.kv_keys import kv_keys
from bus.transport.nats_adapter import KV, KeyNotFoundError, KeyWrongLastSequenceError, Nats
from bus.transport.service import call

R = TypeVar("R")


class NatsBus:
    """`Bus` over one NATS connection."""

    def __init__(self, nc: Nats) -> None:
        self.nc = nc

    async def call(self, subject: str, request: msgspec.Struct, reply: type[R], *, timeout: float) -> R:
        return await call(self.nc, subject, request, reply, timeout=timeout)


class KVReleaseStore:
    """`ReleaseStore` over a JetStream KV bucket (`fauxmad_apps`)."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv

    async def keys(self) -> list[str]:
        return await kv_keys(self.kv)  # from the stream's subjects: nats-py's keys() can miss keys

    async def get(self, key: str) -> bytes | None:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:  # deleted and purged keys too (KeyDeletedError is one)
            return None
        value: bytes | None = entry.value
        return value

    async def create(self, key: str, value: bytes) -> bool:
        try:
            await self.kv.create(key, value)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def put(self, key: str, value: bytes) -> None:
        await self.kv.put(key, value)

    async def purge(self, key: str) -> None:
        await self.kv.purge(key)
