"""Scoring: how desirable is a feasible offer? (Nomad's `rank.go`.)

Each scorer is a small pure function `(request, offer, config) -> float` returning its WEIGHTED
contribution, recorded under its name; the total is their sum, so an explanation adds up on its face
("cpu 0.91 + memory 0.86 + image 0.25 - spread 0.1"). Higher is better; penalties are negative.
Scorers run only on offers every filter accepted, so they may assume capacity > 0 and free >= guest.
"""

from __future__ import annotations

from collections.abc import Callable

from bus.contract.offers import Offer, Resources
from orchestrator.placement.ask import Ask
from orchestrator.placement.config import PlacementConfig, interpolate

Scorer = Callable[[Ask, Offer, PlacementConfig], float]


def utilization_after(capacity: int, free: int, guest: int) -> float:
    """The share of `capacity` booked once `guest` is placed, in [0, 1] for a feasible offer."""
    return (capacity - free + guest) / capacity


def free_after(request: Ask, offer: Offer) -> Resources:
    return Resources(
        cpus=offer.free.cpus - request.guest.cpus,
        memory_mb=offer.free.memory_mb - request.guest.memory_mb,
    )


def cpu(request: Ask, offer: Offer, config: PlacementConfig) -> float:
    used = utilization_after(offer.capacity.cpus, offer.free.cpus, request.guest.cpus)
    return config.cpu_weight * interpolate(config.cpu_curve, used)


def memory(request: Ask, offer: Offer, config: PlacementConfig) -> float:
    used = utilization_after(offer.capacity.memory_mb, offer.free.memory_mb, request.guest.memory_mb)
    return config.memory_weight * interpolate(config.memory_curve, used)


def image(request: Ask, offer: Offer, config: PlacementConfig) -> float:
    """A bonus when the worker already has the image: the machine starts without a pull."""
    return config.image_bonus if request.image is not None and offer.image_cached else 0.0


def spread(request: Ask, offer: Offer, config: PlacementConfig) -> float:
    """Anti-affinity: a penalty per machine of the same app already on the worker."""
    return 0.0 - config.spread_penalty * offer.app_machines


def load(request: Ask, offer: Offer, config: PlacementConfig) -> float:
    """A penalty for a busy host (load average per cpu), which bookings alone do not show."""
    return 0.0 - config.load_weight * offer.load


def away(request: Ask, offer: Offer, config: PlacementConfig) -> float:
    """A penalty on the workers the create would rather not get (`prefer_away`): big enough that any
    other feasible worker wins, yet the worker stays a candidate, so an order is still filled there
    rather than refused (Nomad's `node-reschedule-penalty`)."""
    return 0.0 - config.away_penalty if offer.worker_id in request.away else 0.0


# Name -> scorer; every name appears in every candidate's subscores, zero or not.
SCORERS: tuple[tuple[str, Scorer], ...] = (
    ("cpu", cpu),
    ("memory", memory),
    ("image", image),
    ("spread", spread),
    ("load", load),
    ("away", away),
)


def scorers_for(request: Ask) -> tuple[tuple[str, Scorer | None], ...]:
    """`SCORERS` for one ask, with `None` for a scorer that gives every offer 0 for it (`image` when the create
    names no image, `away` when it would rather avoid no worker): an auction scores every feasible offer of its
    region against one ask, so those are settled once for all of them (`subscores` still names them, at 0)."""
    return tuple(
        (name, None if (scorer is image and request.image is None) or (scorer is away and not request.away) else scorer)
        for name, scorer in SCORERS
    )


def subscores(
    request: Ask,
    offer: Offer,
    config: PlacementConfig,
    scorers: tuple[tuple[str, Scorer | None], ...] = SCORERS,
) -> dict[str, float]:
    """Every scorer's weighted subscore, by name. `scorers`: `SCORERS`, or `scorers_for(request)`, which gives
    the same scores."""
    return {name: 0.0 if scorer is None else scorer(request, offer, config) for name, scorer in scorers}
