"""The release store: KV `fauxmad_apps` as releases use it, a Protocol (`ReleaseStore`) and its JetStream bucket
(`KVReleaseStore`), with nats-py's "no such key" and "key exists" turned into the plain answers the Protocol
promises, so `releases` never sees them and a unit test keeps releases in a dict. Its reads wait through a
JetStream meta-leader election (`bus.transport.election`): a deploy has no other source for its releases.
"""

from __future__ import annotations

from typing import Protocol

from bus.stores.kv_keys import kv_keys
from bus.transport.election import through_election
from bus.transport.nats_adapter import KV, KeyNotFoundError, KeyWrongLastSequenceError


class ReleaseStore(Protocol):
    """KV `fauxmad_apps` as releases use it: whole values under dotted keys, and a create that fails when
    the key exists (how two deployers never claim one release number)."""

    async def keys(self) -> list[str]:
        """Every key (an empty bucket: none)."""
        ...

    async def get(self, key: str) -> bytes | None:
        """The value, or `None` for a key never written, deleted or purged."""
        ...

    async def create(self, key: str, value: bytes) -> bool:
        """Write `value` only if `key` holds nothing; `False`: it did."""
        ...

    async def put(self, key: str, value: bytes) -> None: ...

    async def purge(self, key: str) -> None: ...


class KVReleaseStore:
    """`ReleaseStore` over a JetStream KV bucket (`fauxmad_apps`)."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv

    async def keys(self) -> list[str]:
        return await kv_keys(self.kv)  # from the stream's subjects: nats-py's keys() can miss keys

    async def get(self, key: str) -> bytes | None:
        try:
            entry = await through_election(lambda: self.kv.get(key), f"the apps bucket's {key}")
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
