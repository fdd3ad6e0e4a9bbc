"""Feasibility: can this offer take the machine at all? (Nomad's `feasible.go`.)

Each filter is a small pure function `(request, offer) -> reason | None`: None means feasible, a
string is the named reason a worker was ruled out, shown verbatim by `explain`. Filters never score
and scorers never reject, so "why not this worker" and "why that one" have separate answers.

Offers are information, not promises: a worker already declines when it is full, but the broker
re-checks the numbers it was sent (a buggy or older worker, a reply that raced a change), because a
wrong pick costs a failed `reserve` round trip. Workers that decline (cordoned, overloaded, full) send
a `Decline`, which the stack turns into a rejection with the worker's own reason before any filter
runs; so cordoning needs no filter here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bus.contract.offers import Offer
from orchestrator.placement.ask import Ask

Filter = Callable[[Ask, Offer], str | None]

NO_ANSWER = "no answer within deadline"


def same_region(request: Ask, offer: Offer) -> str | None:
    """A machine for R is never placed in another region (contract), even if a stray worker answers."""
    if offer.region != request.region:
        return f"wrong region: worker is in {offer.region!r}, request is for {request.region!r}"
    return None


def not_avoided(request: Ask, offer: Offer) -> str | None:
    """The create named this worker in `avoid_workers` (a spare away from its primary, a drained host)."""
    if offer.worker_id in request.avoid:
        return "avoided: the create asked for another worker (avoid_workers)"
    return None


def on_volume_host(request: Ask, offer: Offer) -> str | None:
    """A machine that mounts a volume runs where the volume's bytes are (docs/tutorials/images-and-volumes.md)."""
    if request.volume is not None and offer.worker_id != request.volume[1]:
        return f"volume {request.volume[0]} is on worker {request.volume[1]}"
    return None


def consistent_numbers(request: Ask, offer: Offer) -> str | None:
    """Numbers the scorers can trust: capacity > 0, 0 <= free <= capacity, a finite load >= 0."""
    capacity, free = offer.capacity, offer.free
    reason = _inconsistent("cpus", capacity.cpus, free.cpus) or _inconsistent(
        "memory", capacity.memory_mb, free.memory_mb
    )
    if reason is not None:
        return reason
    if not (math.isfinite(offer.load) and offer.load >= 0):
        return f"inconsistent offer: load is {offer.load}"
    return None


def _inconsistent(name: str, capacity: int, free: int) -> str | None:
    if capacity <= 0:
        return f"inconsistent offer: {name} capacity is {capacity}"
    if not 0 <= free <= capacity:
        return f"inconsistent offer: {name} free {free} is outside [0, capacity {capacity}]"
    return None


def enough_cpus(request: Ask, offer: Offer) -> str | None:
    if offer.free.cpus < request.guest.cpus:
        return f"insufficient cpus: needs {request.guest.cpus}, {offer.free.cpus} free"
    return None


def enough_memory(request: Ask, offer: Offer) -> str | None:
    if offer.free.memory_mb < request.guest.memory_mb:
        return f"insufficient memory: needs {request.guest.memory_mb} MB, {offer.free.memory_mb} MB free"
    return None


def has_sandbox(request: Ask, offer: Offer) -> str | None:
    """A sandboxed machine only goes where that sandbox exists (a worker without bubblewrap says so)."""
    wanted = request.guest.sandbox
    if wanted != "none" and wanted not in offer.sandboxes:
        return f"no sandbox {wanted!r} on this worker (bubblewrap is not installed there)"
    return None


# Name -> filter, in the order the stack runs them (see `stack.py` for why this order).
FILTERS: tuple[tuple[str, Filter], ...] = (
    ("region", same_region),
    ("avoid", not_avoided),
    ("volume", on_volume_host),
    ("consistent", consistent_numbers),
    ("cpus", enough_cpus),
    ("memory", enough_memory),
    ("sandbox", has_sandbox),
)


def filters_for(request: Ask) -> tuple[tuple[str, Filter], ...]:
    """The filters that can rule an offer out for `request`, in `FILTERS`' order. `avoid` when the create names
    no worker, `volume` when it mounts none and `sandbox` for a guest without one pass every offer (each returns
    None at once), so an auction, which judges every offer of its region against one ask, leaves them out once
    for all its offers rather than calling them for each (issue 44: the chain was a seventh of the broker's CPU)."""
    return tuple(
        (name, check)
        for name, check in FILTERS
        if not (
            (check is not_avoided and not request.avoid)
            or (check is on_volume_host and request.volume is None)
            or (check is has_sandbox and request.guest.sandbox == "none")
        )
    )


def first_failure(
    request: Ask, offer: Offer, filters: tuple[tuple[str, Filter], ...] = FILTERS
) -> tuple[str, str] | None:
    """The first filter that rules the offer out, as `(filter name, reason)`, or None if feasible. `filters`:
    `FILTERS`, or `filters_for(request)`, which gives the same answer."""
    for name, check in filters:
        reason = check(request, offer)
        if reason is not None:
            return name, reason
    return None
