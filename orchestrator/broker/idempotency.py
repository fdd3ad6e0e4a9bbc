"""Create idempotency across brokers: one key, one machine, whatever times out or dies on the way.

A claim is an atomic KV `create` of `<app>.<sha256(key)>` in bucket `fauxmad_idempotency`. It names
the machine id the create will use (chosen before the auction), so every reserve made for the key,
by any broker, addresses the same machine, and a worker that holds it answers with it.

States: `pending` (a broker is placing), `done` (the machine exists: `machine_id` on `worker_id`) and
`uncertain` (the last owner gave up because a worker did not answer its reserve: `uncertain` lists
the workers that may hold the machine). `tried` lists every worker a reserve was sent to, recorded
before it was sent, so a taker asks exactly the workers that may hold the machine. A placement whose
every reserve was refused deletes the claim, so a retry starts over.

Taking over: a pending claim whose owner died (older than `stale_after`), an uncertain one, or a
pending one of this very broker that no request of it is working on (an attempt that ended in an
error) is taken with a compare-and-set on its revision, so exactly one broker takes it. The taker
gets the old claim back (`Ticket.previous`) and must find out where the machine is before placing.

The same key with a different request is a 409: a key names one request, not a slot to refill.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bus.contract.codec import decoder, encode
from bus.contract.errors import Conflict, Unanswered
from bus.contract.idempotency import Claim, claim_key
from bus.transport.nats_adapter import KV, KeyNotFoundError, KeyWrongLastSequenceError


class Ticket(msgspec.Struct, kw_only=True):
    """What `claim` gives: the claim as it now stands, and the one taken over, if any."""

    claim: Claim
    previous: Claim | None = None
    revision: int = 0  # the claim's revision as this broker wrote it (a fence is a compare-and-set on it)

    @property
    def done(self) -> bool:
        return self.claim.state == "done"


class Idempotency:
    def __init__(self, kv: KV, owner: str, *, stale_after: float = 30.0, clock: Callable[[], float] = time.time):
        self.kv = kv
        self.owner = owner
        self.stale_after = stale_after
        self.clock = clock
        self._active: set[str] = set()  # claims a request of this broker is working on right now

    async def claim(self, app: str, key: str, fingerprint: str, machine_id: str, wait: float = 10.0) -> Ticket:
        """A done claim (nothing to place), or a pending claim this broker now owns."""
        kv_key = claim_key(app, key)
        mine = Claim(state="pending", owner=self.owner, at=self.clock(), machine_id=machine_id, fingerprint=fingerprint)
        deadline = time.perf_counter() + wait
        while True:
            revision = await self._write(kv_key, mine, None)
            if revision is not None:
                self._active.add(kv_key)
                return Ticket(claim=mine, revision=revision)
            entry = await self._read(kv_key)
            if entry is None:
                continue  # released meanwhile: try to claim again
            claim: Claim = decoder(Claim).decode(entry.value)
            if claim.fingerprint and claim.fingerprint != fingerprint:
                raise Conflict(f"idempotency key {key!r} was used for a different request")
            if claim.state == "done":
                return Ticket(claim=claim)
            if self._can_take_over(kv_key, claim):
                taken = msgspec.structs.replace(claim, state="pending", owner=self.owner, at=self.clock())
                revision = await self._write(kv_key, taken, entry.revision)
                if revision is not None:
                    self._active.add(kv_key)
                    return Ticket(claim=taken, previous=claim, revision=revision)
                continue
            if time.perf_counter() > deadline:
                raise Conflict(f"a create with idempotency key {key!r} is still in progress")
            await asyncio.sleep(0.02)

    def _can_take_over(self, kv_key: str, claim: Claim) -> bool:
        if claim.state == "uncertain":
            return True
        if claim.owner == self.owner and kv_key not in self._active:
            return True  # an attempt of ours ended without settling the claim
        return self.clock() - claim.at > self.stale_after

    async def done(self, app: str, key: str, claim: Claim, worker_id: str) -> None:
        value = msgspec.structs.replace(claim, state="done", at=self.clock(), worker_id=worker_id, uncertain=[])
        kv_key = claim_key(app, key)
        try:
            await self._put(kv_key, value)
        finally:
            self._active.discard(kv_key)

    async def trying(self, app: str, key: str, claim: Claim, worker_id: str) -> Claim:
        """Record, before a reserve is sent to `worker_id`, that it may come to hold the claim's machine.

        So whoever takes the claim over knows every worker to ask, whatever the registry knows then (after a
        NATS restart a live worker can be missing from it for a heartbeat). If the record cannot be written,
        this raises and the reserve is not sent.
        """
        if worker_id in claim.tried:
            return claim
        recorded = msgspec.structs.replace(claim, tried=[*claim.tried, worker_id])
        await self._put(claim_key(app, key), recorded)
        return recorded

    async def uncertain(self, app: str, key: str, claim: Claim, workers: list[str]) -> None:
        """Give the claim up, naming the workers that may hold the machine, for the next try to ask."""
        value = msgspec.structs.replace(claim, state="uncertain", uncertain=sorted(set(workers)))
        kv_key = claim_key(app, key)
        try:
            with contextlib.suppress(Unanswered):
                await self._put(kv_key, value)
        finally:
            self._active.discard(kv_key)

    async def fence(self, app: str, key: str, ticket: Ticket, gone: list[str], machine_id: str) -> Claim | None:
        """Fence `gone` (silent workers whose heartbeat expired, that may hold the claim's machine): the claim
        names a new machine id and those workers, in one compare-and-set on the revision this broker took it
        at. None if the claim moved meanwhile (a fenced worker came back and settled it on itself)."""
        fenced = sorted({*ticket.claim.fenced, *gone})
        value = msgspec.structs.replace(
            ticket.claim, machine_id=machine_id, fenced=fenced, tried=[], uncertain=[], at=self.clock()
        )
        if await self._write(claim_key(app, key), value, ticket.revision) is None:
            return None
        return value

    async def current(self, app: str, key: str) -> Claim | None:
        entry = await self._read(claim_key(app, key))
        return None if entry is None else decoder(Claim).decode(entry.value)

    async def refused(self, app: str, key: str, claim: Claim) -> None:
        """Every reserve of the claim's machine was refused: nothing holds it. Forget the key, unless the claim
        fences a worker (its copy of an earlier machine must keep finding that it is not the key's)."""
        if claim.fenced:
            await self.uncertain(app, key, claim, [])
        else:
            await self.release(app, key)

    async def release_hold(self, app: str, key: str) -> None:
        """This broker is no longer working on the claim, which someone else settled: leave it as it is."""
        self._active.discard(claim_key(app, key))

    async def release(self, app: str, key: str) -> None:
        kv_key = claim_key(app, key)
        self._active.discard(kv_key)
        with contextlib.suppress(Exception):
            await self.kv.delete(kv_key)

    # ------------------------------------------------------------------------------------------
    # the KV, with its failures turned into the error contract: a write whose answer was lost
    # may have happened (Unanswered), and the caller's retry will find out.

    async def _write(self, kv_key: str, claim: Claim, revision: int | None) -> int | None:
        """The new revision, or None if the key was not at `revision` (or existed, for a create)."""
        try:
            if revision is None:
                return int(await self.kv.create(kv_key, encode(claim)))
            return int(await self.kv.update(kv_key, encode(claim), last=revision))
        except KeyWrongLastSequenceError:
            return None
        except Exception as exc:
            raise Unanswered(f"idempotency store unavailable: {exc!r}") from None

    async def _read(self, kv_key: str) -> Any:
        try:
            return await self.kv.get(kv_key)
        except KeyNotFoundError:
            return None
        except Exception as exc:
            raise Unanswered(f"idempotency store unavailable: {exc!r}") from None

    async def _put(self, kv_key: str, claim: Claim) -> None:
        try:
            await self.kv.put(kv_key, encode(claim))
        except Exception as exc:
            raise Unanswered(f"idempotency store unavailable: {exc!r}") from None
