"""How a worker answers an auction: an offer with its numbers, or a decline with a named reason.

A pure function of the request and the worker's current numbers, so it is tested without NATS and
answered inline on the offers subscription (no task, no I/O). Offers are information, not promises:
the reservation that follows re-checks capacity atomically in LMDB.
"""

from __future__ import annotations

import msgspec

from bus.contract.offers import Decline, Offer, OfferReply, OfferRequest, Resources


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """What the worker knows of itself when an offer request arrives."""

    worker_id: str
    region: str
    capacity: Resources
    used: Resources
    machines: int
    cordoned: bool
    images: frozenset[str]
    load: float
    inflight: int
    app_machines: dict[str, int] = {}
    sandboxes: tuple[str, ...] = ()


class Backpressure(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds past which a worker declines: too many launches in flight, or a busy host.

    `max_load` is the 1-minute load average per cpu; 0 turns the check off. A dev fleet turns it off: its
    simulated hosts share one kernel, whose load average is none of theirs (and counts threads waiting on
    disk), so every one of them would decline at once and leave no better host to place on."""

    max_inflight: int = 64
    max_load: float = 8.0


def answer_offer(request: OfferRequest, me: Snapshot, limits: Backpressure) -> OfferReply:
    free = Resources(cpus=me.capacity.cpus - me.used.cpus, memory_mb=me.capacity.memory_mb - me.used.memory_mb)

    def decline(reason: str) -> Decline:
        return Decline(worker_id=me.worker_id, region=me.region, reason=reason, free=free)

    if me.cordoned:
        return decline("cordoned")
    if me.inflight >= limits.max_inflight:
        return decline(f"overloaded: {me.inflight} launches in flight")
    if limits.max_load and me.load >= limits.max_load:
        return decline(f"overloaded: load {me.load:.2f} per cpu")
    if request.guest.cpus > free.cpus:
        return decline(f"insufficient cpus: needs {request.guest.cpus}, {free.cpus} free")
    if request.guest.memory_mb > free.memory_mb:
        return decline(f"insufficient memory: needs {request.guest.memory_mb} MB, {free.memory_mb} MB free")
    return Offer(
        worker_id=me.worker_id,
        region=me.region,
        capacity=me.capacity,
        free=free,
        image_cached=request.image is not None and request.image in me.images,
        machines=me.machines,
        load=me.load,
        app_machines=me.app_machines.get(request.app, 0),
        sandboxes=list(me.sandboxes),
    )
