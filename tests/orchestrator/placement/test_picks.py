"""Unit tests of pure placement pieces: picks discount offers, heartbeats become offers, presets swap curves."""

from __future__ import annotations

import pytest

from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Decline, Offer, Resources
from orchestrator.placement import PlacementConfig, with_preset
from orchestrator.placement.picks import Picks, discount, offer_from_heartbeat


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def offer(worker_id: str = "w1", cpus: int = 4, memory_mb: int = 1024, app_machines: int = 0) -> Offer:
    return Offer(
        worker_id=worker_id,
        region="r",
        capacity=Resources(cpus=8, memory_mb=4096),
        free=Resources(cpus=cpus, memory_mb=memory_mb),
        machines=1,
        app_machines=app_machines,
    )


def test_discount_takes_the_guests_off_and_counts_the_machines() -> None:
    picks = Picks(clock=Clock())
    made = [picks.note("w1", "a", 1, 256), picks.note("w1", "b", 2, 256)]
    less = discount(offer(), made, "a")
    assert less.free == Resources(cpus=1, memory_mb=512)
    assert (less.machines, less.app_machines) == (3, 1)


def test_discount_stops_at_zero_so_the_fit_filters_say_why() -> None:
    picks = Picks(clock=Clock())
    less = discount(offer(cpus=1), [picks.note("w1", "a", 4, 64)], "a")
    assert less.free.cpus == 0


def test_a_scattered_offer_shows_picks_made_before_it_was_asked_for() -> None:
    clock = Clock()
    picks = Picks(clock=clock)
    picks.note("w1", "a", 1, 64)
    clock.now = 101.0
    sent = clock.now
    clock.now = 102.0
    after = picks.note("w1", "a", 1, 64)
    assert picks.since_scatter("w1", sent) == [after]
    assert picks.since_scatter("w2", sent) == []


def test_a_heartbeat_shows_picks_reserved_before_it_was_written() -> None:
    picks = Picks(clock=Clock())
    old, new, pending = (picks.note("w1", "a", 1, 64) for _ in range(3))
    picks.reserved(old, 50.0)
    picks.reserved(new, 59.8)  # reserved just before the heartbeat: it may have been read before the commit
    assert picks.since_heartbeat("w1", 60.0) == [new, pending]


def test_dropped_and_old_picks_are_forgotten() -> None:
    clock = Clock()
    picks = Picks(clock=clock, horizon=10.0)
    refused = picks.note("w1", "a", 1, 64)
    picks.drop(refused)
    assert picks.since_scatter("w1", 0.0) == []
    picks.note("w1", "a", 1, 64)
    clock.now += 11.0
    fresh = picks.note("w1", "a", 1, 64)
    assert picks.since_scatter("w1", 0.0) == [fresh]


def heartbeat(cordoned: bool = False) -> WorkerInfo:
    return WorkerInfo(
        worker_id="w1",
        region="r",
        capacity=Resources(cpus=8, memory_mb=4096),
        used=Resources(cpus=2, memory_mb=1024),
        machines=2,
        cordoned=cordoned,
        images=["img:1"],
        app_machines={"a": 2},
    )


def test_a_heartbeat_becomes_the_offer_the_worker_would_make() -> None:
    made = offer_from_heartbeat(heartbeat(), "a", "img:1")
    assert isinstance(made, Offer)
    assert made.free == Resources(cpus=6, memory_mb=3072)
    assert (made.image_cached, made.machines, made.app_machines) == (True, 2, 2)
    assert isinstance(offer_from_heartbeat(heartbeat(), "b", None), Offer)
    assert offer_from_heartbeat(heartbeat(), "b", None).app_machines == 0  # type: ignore[union-attr]


def test_a_cordoned_heartbeat_declines() -> None:
    made = offer_from_heartbeat(heartbeat(cordoned=True), "a", None)
    assert isinstance(made, Decline) and made.reason == "cordoned"


def test_presets_swap_the_curves_and_keep_the_weights() -> None:
    tuned = PlacementConfig(spread_penalty=2.0)
    packed = with_preset(tuned, "binpack")
    assert packed.spread_penalty == 2.0 and packed.cpu_curve[0][1] < packed.cpu_curve[-1][1]
    spread = with_preset(tuned, "spread")
    assert spread.cpu_curve[0][1] > spread.cpu_curve[-1][1]
    assert with_preset(tuned, None) is tuned
    with pytest.raises(ValueError, match="unknown"):
        with_preset(tuned, "random")


def test_a_pick_goes_once_a_heartbeat_shows_it_and_no_scatter_can_need_it() -> None:
    clock = Clock()
    picks = Picks(clock=clock, window=0.25, horizon=10.0)
    shown = picks.note("w1", "a", 1, 64)
    picks.reserved(shown, 50.0)
    unshown = picks.note("w1", "a", 1, 64)
    picks.reserved(unshown, 59.8)
    assert picks.since_heartbeat("w1", 60.0) == [unshown]  # the heartbeat of 60.0 surely shows the first
    clock.now += 1.0
    latest = picks.note("w1", "a", 1, 64)  # older ones are looked at again here
    assert picks.since_scatter("w1", 0.0) == [latest, unshown]  # the shown one is gone, newest first
