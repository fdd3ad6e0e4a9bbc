"""Leases: who may change a machine for the next few seconds, checked inside the commit that changes it.

A lease is a record on the machine (nonce, holder, expiry), not a lock held in memory: it survives a worker
restart and is judged by the clock of the commit that reads it. Every verb that changes a machine checks it
with `check` in its own transaction, so a lease and the change it guards can never interleave. Taking and
releasing one are transactions of their own (`take`, `release`); the manager commits them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from bus.contract.errors import Conflict
from bus.contract.machines import Lease, LeaseRequest, ReleaseRequest
from workers.log.records import StoredMachine
from workers.log.store import Tx


def check(stored: StoredMachine, nonce: str | None, now: float) -> None:
    """Refuse a change to a machine someone else holds a lease on (`nonce`: the caller's, if it holds it)."""
    lease = stored.machine.lease
    if lease is None or lease.expires_at <= now or lease.nonce == nonce:
        return
    holder = f" by {lease.holder}" if lease.holder else ""
    raise Conflict(f"machine {stored.machine.id} is leased{holder} for {lease.expires_at - now:.1f}s more")


def take(request: LeaseRequest) -> Callable[[Tx], Lease]:
    """The transaction that takes or renews a lease (a renewal names the nonce it holds)."""

    def op(tx: Tx) -> Lease:
        stored = tx.require(request.id)
        if stored.machine.state == "destroyed":
            raise Conflict(f"machine {request.id} is destroyed")
        current = stored.machine.lease
        if current is not None and current.expires_at > tx.now and current.nonce != request.nonce:
            check(stored, request.nonce, tx.now)
        nonce = request.nonce if current is not None and current.nonce == request.nonce else secrets.token_hex(8)
        stored.machine.lease = Lease(nonce=nonce, holder=request.holder, expires_at=tx.now + request.ttl)
        tx.put_machine(stored, "lease")
        return stored.machine.lease

    return op


def release(request: ReleaseRequest) -> Callable[[Tx], StoredMachine]:
    """The transaction that gives a lease back (an expired one is gone already: nothing is written)."""

    def op(tx: Tx) -> StoredMachine:
        stored = tx.require(request.id)
        lease = stored.machine.lease
        if lease is None or lease.expires_at <= tx.now:
            stored.machine.lease = None
            return stored
        if lease.nonce != request.nonce:
            raise Conflict(f"machine {request.id}: lease nonce does not match")
        stored.machine.lease = None
        tx.put_machine(stored, "release")
        return stored

    return op
