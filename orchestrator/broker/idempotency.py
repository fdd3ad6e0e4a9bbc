"""Create idempotency across brokers: the first broker to claim a key places; the others wait for it.

A claim is an atomic KV `create` of `<app>.<sha256(key)>` in bucket `fauxmad_idempotency`. The owner
places the machine and records its id; a failed placement releases the claim so a retry can try
again. A claim whose owner died (older than `stale_after`) is taken over with a compare-and-set on
its revision, so exactly one broker takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from bus.codec import decoder, encode
from bus.errors import Conflict


class Claim(msgspec.Struct, kw_only=True):
    state: str  # "pending" | "done"
    owner: str
    at: float
    machine_id: str | None = None
    worker_id: str | None = None


def claim_key(app: str, key: str) -> str:
    return f"{app}.{hashlib.sha256(key.encode()).hexdigest()[:40]}"


class Idempotency:
    def __init__(self, kv: Any, owner: str, *, stale_after: float = 30.0, clock: Callable[[], float] = time.time):
        self.kv = kv
        self.owner = owner
        self.stale_after = stale_after
        self.clock = clock

    async def claim(self, app: str, key: str, wait: float = 10.0) -> Claim | None:
        """`None`: this broker owns the key now and must place. A `Claim`: it is done already."""
        kv_key = claim_key(app, key)
        mine = encode(Claim(state="pending", owner=self.owner, at=self.clock()))
        deadline = time.perf_counter() + wait
        while True:
            try:
                await self.kv.create(kv_key, mine)
                return None
            except KeyWrongLastSequenceError:
                pass
            try:
                entry = await self.kv.get(kv_key)
            except KeyNotFoundError:
                continue  # released meanwhile: try to claim again
            claim: Claim = decoder(Claim).decode(entry.value)
            if claim.state == "done":
                return claim
            if self.clock() - claim.at > self.stale_after:
                try:
                    await self.kv.update(kv_key, mine, last=entry.revision)
                    return None
                except KeyWrongLastSequenceError:
                    continue
            if time.perf_counter() > deadline:
                raise Conflict(f"a create with idempotency key {key!r} is still in progress")
            await asyncio.sleep(0.02)

    async def done(self, app: str, key: str, machine_id: str, worker_id: str) -> None:
        value = Claim(state="done", owner=self.owner, at=self.clock(), machine_id=machine_id, worker_id=worker_id)
        await self.kv.put(claim_key(app, key), encode(value))

    async def release(self, app: str, key: str) -> None:
        with contextlib.suppress(Exception):
            await self.kv.delete(claim_key(app, key))
