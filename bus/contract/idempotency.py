"""Create idempotency claims, and the fence every party applies to them (a contract: brokers and workers).

A claim is the value of `<app>.<sha256(key)>` in KV `fauxmad_idempotency` (in a supercluster, the region's
own bucket). It names the one machine a create with that key may have: brokers write it (claim, record each
worker they send a reserve to, settle it), and a worker that comes back from an absence reads it.

**The fence.** A broker that takes a key over asks every worker that may hold the key's machine. A worker
that does not answer and whose heartbeat has expired (it is frozen, cut off or dead) is not waited for:
the broker *fences* it with one compare-and-set of the claim, which gives the key a new machine id and
names that worker in `fenced`. Only then is anything placed. A machine id is therefore reserved on one
worker at most, ever.

A worker that was away (its heartbeat lapsed: a freeze, a lost connection, a restart) must not run a
keyed machine it reserved before the absence until the claim says it is still the key's machine
(`verdict`): the claim names another machine, so its copy is destroyed without running (`elsewhere`); or
the claim names this very machine, and the worker settles it `done` on itself with a compare-and-set
(`ours`), so a broker that wanted to fence it finds the claim moved and answers with this machine
instead. Whichever compare-and-set lands first wins; the other party yields. A missing claim (expired
after its 24 h, or never written) leaves the machine as it is.

A claim is deleted only when every reserve made for it was refused (nothing is held anywhere) and no
worker is fenced; with a fence, a refused placement leaves it `uncertain`, so the next try still carries
the fence and a fenced worker that comes back still finds its copy is not the key's.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import msgspec

ClaimState = Literal["pending", "done", "uncertain"]
Verdict = Literal["ours", "elsewhere", "unknown"]


class Claim(msgspec.Struct, kw_only=True):
    state: str  # "pending" | "done" | "uncertain"
    owner: str  # the broker that wrote it last (a worker that settled it: "worker:<id>")
    at: float
    machine_id: str | None = None
    worker_id: str | None = None
    fingerprint: str = ""
    uncertain: list[str] = []
    tried: list[str] = []  # every worker a reserve for `machine_id` was sent to, recorded before it was sent
    fenced: list[str] = []  # workers fenced so far: each may hold a copy of an earlier machine id, never to run


def claim_key(app: str, key: str) -> str:
    return f"{app}.{hashlib.sha256(key.encode()).hexdigest()[:40]}"


def verdict(claim: Claim | None, machine_id: str, worker_id: str) -> Verdict | None:
    """What a worker that was away does with its keyed machine `machine_id`, given the key's claim: `ours`
    (run it), `elsewhere` (destroy it, never run it), or None: the claim names this machine but is not
    settled on this worker, so the worker settles it (compare-and-set) and asks again."""
    if claim is None:
        return "ours"
    if claim.machine_id != machine_id:
        return "elsewhere"
    if claim.state == "done":
        return "ours" if claim.worker_id == worker_id else "elsewhere"
    return None


def settled_on(claim: Claim, worker_id: str, now: float) -> Claim:
    """The claim settled `done` on `worker_id` by the worker itself (it holds the machine the claim names)."""
    return msgspec.structs.replace(
        claim, state="done", owner=f"worker:{worker_id}", at=now, worker_id=worker_id, uncertain=[]
    )
