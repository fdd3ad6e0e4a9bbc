"""Placement as pure functions: filters and their reasons, curves, scores, ordering, explain, p2c."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.contract.fleet import WorkerInfo
from bus.contract.machines import Guest
from bus.contract.offers import Decline, Offer, OfferRequest, Resources
from orchestrator.placement import (
    NO_ANSWER,
    SCORERS,
    Curve,
    PlacementConfig,
    explain,
    interpolate,
    rank,
)
from orchestrator.placement.ask import Ask
from orchestrator.placement.feasible import (
    FILTERS,
    consistent_numbers,
    enough_cpus,
    enough_memory,
    filters_for,
    same_region,
)
from orchestrator.placement.score import scorers_for
from orchestrator.placement.stack import judge
from orchestrator.replicas.workers import Registry

CONFIG = PlacementConfig()


def request(cpus: int = 1, memory_mb: int = 256, image: str | None = None, region: str = "mad") -> OfferRequest:
    return OfferRequest(app="web", region=region, guest=Guest(cpus=cpus, memory_mb=memory_mb), image=image)


def offer(
    worker_id: str,
    *,
    cpus: int = 8,
    memory_mb: int = 8192,
    free_cpus: int | None = None,
    free_mb: int | None = None,
    region: str = "mad",
    **extra: Any,
) -> Offer:
    return Offer(
        worker_id=worker_id,
        region=region,
        capacity=Resources(cpus=cpus, memory_mb=memory_mb),
        free=Resources(
            cpus=cpus if free_cpus is None else free_cpus,
            memory_mb=memory_mb if free_mb is None else free_mb,
        ),
        **extra,
    )


def ids(ranking: Any) -> list[str]:
    return [c.worker_id for c in ranking.candidates]


# --- filters ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "reply", "expected"),
    [
        (same_region, offer("w"), None),
        (same_region, offer("w", region="ams"), "wrong region: worker is in 'ams', request is for 'mad'"),
        (consistent_numbers, offer("w"), None),
        (consistent_numbers, offer("w", cpus=0, free_cpus=0), "inconsistent offer: cpus capacity is 0"),
        (consistent_numbers, offer("w", free_mb=9000), "inconsistent offer: memory free 9000 is outside"),
        (consistent_numbers, offer("w", free_cpus=-1), "inconsistent offer: cpus free -1 is outside"),
        (consistent_numbers, offer("w", load=float("nan")), "inconsistent offer: load is nan"),
        (consistent_numbers, offer("w", load=-1.0), "inconsistent offer: load is -1.0"),
        (enough_cpus, offer("w", free_cpus=2), None),
        (enough_cpus, offer("w", free_cpus=1), "insufficient cpus: needs 2, 1 free"),
        (enough_memory, offer("w", free_mb=512), None),
        (enough_memory, offer("w", free_mb=511), "insufficient memory: needs 512 MB, 511 MB free"),
    ],
)
def test_each_filter_names_its_reason(check: Any, reply: Offer, expected: str | None) -> None:
    reason = check(request(cpus=2, memory_mb=512), reply)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(expected)


@pytest.mark.parametrize(
    ("reply", "filter_name", "reason"),
    [
        (Decline(worker_id="w", reason="cordoned"), "declined", "cordoned"),
        (Decline(worker_id="w", reason="overloaded: load 9.00 per cpu"), "declined", "overloaded: load 9.00 per cpu"),
        (Decline(worker_id="w", reason=""), "declined", "declined"),
        (offer("w", region="ams"), "region", "wrong region"),
        (offer("w", free_mb=100), "memory", "insufficient memory"),
        (offer("w", free_cpus=0), "cpus", "insufficient cpus"),
        (offer("w", free_cpus=0, free_mb=0), "cpus", "insufficient cpus"),  # first failing filter wins
    ],
)
def test_rank_rejects_with_the_filter_and_reason(reply: Offer | Decline, filter_name: str, reason: str) -> None:
    ranking = rank(request(), [reply], {"w"}, CONFIG)
    assert ranking.candidates == []
    [rejection] = ranking.rejected
    assert (rejection.worker_id, rejection.filter) == ("w", filter_name)
    assert rejection.reason.startswith(reason)


def test_a_full_worker_is_rejected_with_a_reason_naming_the_resource() -> None:
    replies = [offer("cpu-full", free_cpus=0), offer("mem-full", free_mb=0), offer("roomy")]
    ranking = rank(request(), replies, {"cpu-full", "mem-full", "roomy"}, CONFIG)
    assert ids(ranking) == ["roomy"]
    reasons = {r.worker_id: r.reason for r in ranking.rejected}
    assert "cpus" in reasons["cpu-full"] and "memory" in reasons["mem-full"]


def test_workers_that_did_not_answer_are_rejected_for_the_deadline() -> None:
    ranking = rank(request(), [offer("a")], {"a", "b", "c"}, CONFIG)
    assert ids(ranking) == ["a"]
    assert [(r.worker_id, r.filter, r.reason) for r in ranking.rejected] == [
        ("b", "deadline", NO_ANSWER),
        ("c", "deadline", NO_ANSWER),
    ]
    assert NO_ANSWER == "no answer within deadline"


# --- curves and scores -----------------------------------------------------------------------------

CURVE: Curve = ((0.2, 0.0), (0.6, 1.0), (0.9, 0.4))


@pytest.mark.parametrize(
    ("utilization", "score"),
    [
        (0.2, 0.0),  # on a point
        (0.6, 1.0),
        (0.9, 0.4),
        (0.4, 0.5),  # between points
        (0.75, 0.7),
        (0.0, 0.0),  # clamped below the first point
        (1.0, 0.4),  # clamped above the last point
    ],
)
def test_curves_interpolate_linearly_and_clamp(utilization: float, score: float) -> None:
    assert interpolate(CURVE, utilization) == pytest.approx(score)


def test_scores_follow_utilization_after_placement() -> None:
    # 8 cpus, 4.6 free, guest 1 -> after placement (8 - 5 + 1) / 8 = 0.5; default cpu curve there.
    ranking = rank(request(cpus=1, memory_mb=1024), [offer("w", free_cpus=5, free_mb=4096)], {"w"}, CONFIG)
    [candidate] = ranking.candidates
    assert candidate.subscores["cpu"] == pytest.approx(0.2 + 0.8 * 0.5 / 0.7)
    assert candidate.subscores["memory"] == pytest.approx(0.2 + 0.8 * (5120 / 8192) / 0.7)
    assert candidate.free_after == Resources(cpus=4, memory_mb=3072)
    assert set(candidate.subscores) == {name for name, _ in SCORERS}
    assert candidate.total == pytest.approx(sum(candidate.subscores.values()))


def test_a_cached_image_wins_a_tie() -> None:
    replies = [offer("a"), offer("b", image_cached=True)]
    ranking = rank(request(image="registry/web:1"), replies, {"a", "b"}, CONFIG)
    assert ids(ranking) == ["b", "a"]
    assert ranking.candidates[0].subscores["image"] == CONFIG.image_bonus
    # No image asked for: a cached flag means nothing, and the id breaks the tie.
    assert ids(rank(request(), replies, {"a", "b"}, CONFIG)) == ["a", "b"]


def test_spread_prefers_a_worker_without_the_app() -> None:
    replies = [offer("a", app_machines=2), offer("b")]
    ranking = rank(request(), replies, {"a", "b"}, CONFIG)
    assert ids(ranking) == ["b", "a"]
    assert ranking.candidates[1].subscores["spread"] == pytest.approx(-2 * CONFIG.spread_penalty)


def test_load_penalizes_a_busy_host() -> None:
    ranking = rank(request(), [offer("a", load=3.0), offer("b", load=0.5)], {"a", "b"}, CONFIG)
    assert ids(ranking) == ["b", "a"]


def test_bin_packing_with_headroom_prefers_the_fuller_worker_below_the_peak() -> None:
    replies = [offer("empty"), offer("half", free_cpus=4, free_mb=4096), offer("full", free_cpus=1, free_mb=256)]
    ranking = rank(request(cpus=1, memory_mb=256), replies, {"empty", "half", "full"}, CONFIG)
    assert ids(ranking) == ["half", "full", "empty"]


# --- ordering --------------------------------------------------------------------------------------


def test_ordering_is_deterministic_whatever_the_arrival_order() -> None:
    replies: list[Offer | Decline] = [
        offer(f"w{i}", free_cpus=i % 4 + 1, free_mb=1024 * (i % 3 + 1), app_machines=i % 2) for i in range(12)
    ]
    replies.append(Decline(worker_id="cordoned", reason="cordoned"))
    live = {f"w{i}" for i in range(12)} | {"cordoned", "silent"}
    expected = rank(request(), replies, live, CONFIG)
    for seed in range(5):
        shuffled = replies[:]
        random.Random(seed).shuffle(shuffled)
        assert rank(request(), shuffled, live, CONFIG) == expected


def test_ties_go_to_more_free_memory_then_worker_id() -> None:
    # "big" is twice the size with the same utilization after placement (cpu 0.75, memory 0.625):
    # equal totals, but more memory left over, so it goes first; "a" and "b" are identical.
    replies = [
        offer("b", free_cpus=4, free_mb=4096),
        offer("a", free_cpus=4, free_mb=4096),
        offer("big", cpus=16, memory_mb=16384, free_cpus=6, free_mb=7168),
    ]
    ranking = rank(request(cpus=2, memory_mb=1024), replies, {"a", "b", "big"}, CONFIG)
    assert len({c.total for c in ranking.candidates}) == 1
    assert ids(ranking) == ["big", "a", "b"]


def test_a_seeded_tie_break_is_reproducible_and_only_breaks_ties() -> None:
    replies = [offer(f"w{i}") for i in range(20)] + [offer("best", image_cached=True)]
    live = {r.worker_id for r in replies}
    req = request(image="img")
    first = rank(req, replies, live, CONFIG, tie_break=random.Random(7))
    again = rank(req, list(reversed(replies)), live, CONFIG, tie_break=random.Random(7))
    assert first == again
    assert ids(first)[0] == "best"
    orders = {tuple(ids(rank(req, replies, live, CONFIG, tie_break=random.Random(s)))) for s in range(5)}
    assert len(orders) > 1


def test_a_duplicate_reply_is_judged_once_on_the_first() -> None:
    ranking = rank(request(), [offer("a"), Decline(worker_id="a", reason="cordoned")], {"a"}, CONFIG)
    assert ids(ranking) == ["a"] and ranking.rejected == []


# --- explain ---------------------------------------------------------------------------------------


def test_explain_lists_every_worker_exactly_once() -> None:
    replies: list[Offer | Decline] = [
        offer("a"),
        offer("b", image_cached=True),
        offer("small", free_mb=64),
        Decline(worker_id="cordoned", reason="cordoned"),
        offer("late-registry"),  # answered, not yet in the registry
    ]
    live = {"a", "b", "small", "cordoned", "silent"}
    ranking = rank(request(image="img"), replies, live, CONFIG)
    report = explain(ranking)
    names = [w.worker_id for w in report.workers]
    assert sorted(names) == sorted(live | {"late-registry"})
    assert len(names) == len(set(names)) == len(ranking.candidates) + len(ranking.rejected)
    assert report.winner == "b"
    by_id = {w.worker_id: w for w in report.workers}
    assert by_id["b"].rank == 1 and by_id["b"].subscores["image"] == CONFIG.image_bonus
    assert (by_id["small"].filter, by_id["cordoned"].reason, by_id["silent"].reason) == (
        "memory",
        "cordoned",
        NO_ANSWER,
    )
    assert by_id["late-registry"].outcome == "candidate" and not by_id["late-registry"].registered
    assert by_id["late-registry"].note is not None and "registry" in by_id["late-registry"].note
    assert ranking.unregistered == ["late-registry"]


def test_explain_is_json_and_leaves_out_what_does_not_apply() -> None:
    ranking = rank(request(), [offer("a"), Decline(worker_id="d", reason="cordoned")], {"a", "d"}, CONFIG)
    decoded = msgspec.json.decode(msgspec.json.encode(explain(ranking)))
    assert decoded["winner"] == "a"
    candidate, rejected = decoded["workers"]
    assert set(candidate) == {"worker_id", "outcome", "rank", "total", "subscores", "free_after"}
    assert rejected == {"worker_id": "d", "outcome": "rejected", "filter": "declined", "reason": "cordoned"}


def test_explain_with_no_candidates_has_no_winner() -> None:
    report = explain(rank(request(), [], {"a"}, CONFIG))
    assert report.winner is None and [w.reason for w in report.workers] == [NO_ANSWER]


# --- configuration ---------------------------------------------------------------------------------


def test_config_from_mapping_accepts_numbers_and_lists() -> None:
    config = PlacementConfig.from_mapping({"cpu_curve": [[0, 1], [1, 0]], "image_bonus": 1, "load_weight": 0.5})
    assert config.cpu_curve == ((0.0, 1.0), (1.0, 0.0))
    assert (config.image_bonus, config.load_weight, config.memory_curve) == (1.0, 0.5, CONFIG.memory_curve)
    assert PlacementConfig.from_mapping({}) == CONFIG


@pytest.mark.parametrize(
    ("mapping", "key"),
    [
        ({"cpu_curve": [[0.5, 1.0], [0.2, 0.0]]}, "cpu_curve"),  # not sorted
        ({"memory_curve": [[0.2, 1.0], [0.2, 0.0]]}, "memory_curve"),  # not strictly increasing
        ({"cpu_curve": [[0.0, 1.0]]}, "cpu_curve"),  # one point
        ({"memory_curve": [[0.0, 1.0], [1.5, 0.0]]}, "memory_curve"),  # utilization > 1
        ({"cpu_curve": [[-0.1, 1.0], [1.0, 0.0]]}, "cpu_curve"),  # utilization < 0
        ({"cpu_curve": [[0.0, 1.0, 2.0], [1.0, 0.0]]}, "cpu_curve"),  # not a pair
        ({"cpu_curve": "steep"}, "cpu_curve"),
        ({"memory_curve": [[0.0, float("inf")], [1.0, 0.0]]}, "memory_curve"),
        ({"cpu_weight": -1}, "cpu_weight"),
        ({"memory_weight": "heavy"}, "memory_weight"),
        ({"image_bonus": True}, "image_bonus"),
        ({"spread_penalty": float("nan")}, "spread_penalty"),
        ({"load_weight": -0.1}, "load_weight"),
        ({"cpu_curvature": 1}, "cpu_curvature"),  # unknown key
    ],
)
def test_config_errors_are_one_line_naming_the_key(mapping: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key) as caught:
        PlacementConfig.from_mapping(mapping)
    assert "\n" not in str(caught.value)


def test_config_built_in_code_is_validated_too() -> None:
    with pytest.raises(ValueError, match="image_bonus"):
        PlacementConfig(image_bonus=-1.0)


# --- power of two choices --------------------------------------------------------------------------


def registry_of(count: int, clock: Callable[[], float], *, region: str = "r") -> Registry:
    registry = Registry(ttl=5.0, clock=clock)
    for i in range(count):
        info = WorkerInfo(
            worker_id=f"w{i}",
            region=region,
            capacity=Resources(cpus=4, memory_mb=4096),
            used=Resources(cpus=0, memory_mb=0),
            heartbeat_at=clock(),
        )
        registry.apply(f"{region}.w{i}", msgspec.json.encode(info))
    return registry


def test_the_registry_samples_two_distinct_live_workers_reproducibly() -> None:
    registry = registry_of(1000, lambda: 100.0)
    for seed in range(20):
        picked = registry.sample("r", 2, random.Random(seed))
        assert picked is not None and len(set(picked)) == 2
        assert registry.sample("r", 2, random.Random(seed)) == picked
    assert len({tuple(registry.sample("r", 2, random.Random(s)) or ()) for s in range(20)}) > 1


def test_the_registry_sample_skips_excluded_and_gone_workers() -> None:
    now = [100.0]
    registry = registry_of(10, lambda: now[0])
    for second in range(101, 107):  # w9 beats every second; the others stop (a bucket's silence would not count)
        fresh = WorkerInfo(
            worker_id="w9",
            region="r",
            capacity=Resources(cpus=4, memory_mb=4096),
            used=Resources(),
            heartbeat_at=second,
        )
        now[0] = float(second)  # at 106 every heartbeat but w9's is older than the ttl
        registry.apply("r.w9", msgspec.json.encode(fresh))
    drawn = [registry.sample("r", 1, random.Random(seed)) for seed in range(40)]
    assert all(d in (["w9"], None) for d in drawn) and ["w9"] in drawn, drawn
    now[0] = 100.0
    for seed in range(30):
        picked = registry.sample("r", 2, random.Random(seed), exclude={"w0", "w1"})
        assert picked is None or not {"w0", "w1"} & set(picked)


def test_a_silence_of_the_whole_bucket_is_the_store_s_not_every_worker_s() -> None:
    """No heartbeat from anyone (the bucket electing a leader after a server died): the workers stay listed up to
    SILENCE_LIMIT, expiry markers meanwhile remove none, and once beats are back each has a TTL to beat again."""
    now = [100.0]
    registry = registry_of(3, lambda: now[0])
    now[0] = 108.0  # 8 s of silence: past the 5 s ttl
    assert [w.worker_id for w in registry.workers()] == ["w0", "w1", "w2"]
    registry.apply("r.w0", None)  # its key expired for the store's silence
    assert registry.live_ids("r") == {"w0", "w1", "w2"}
    back = WorkerInfo(
        worker_id="w1", region="r", capacity=Resources(cpus=4, memory_mb=4096), used=Resources(), heartbeat_at=109.0
    )
    now[0] = 109.0
    registry.apply("r.w1", msgspec.json.encode(back))  # beats are back: the others get a ttl from now
    now[0] = 111.0
    assert registry.live_ids("r") == {"w0", "w1", "w2"}
    for second in (111.0, 113.0, 114.5):  # w1 beats on; w0 and w2 never again: gone a ttl after the silence ended
        now[0] = second
        registry.apply("r.w1", msgspec.json.encode(msgspec.structs.replace(back, heartbeat_at=second)))
    assert registry.live_ids("r") == {"w1"}
    later = [100.0]
    quiet = registry_of(3, lambda: later[0])
    later[0] = 125.0
    assert quiet.workers() == []  # a silence longer than SILENCE_LIMIT (20 s) is every worker's


def test_a_new_watch_replaying_the_last_beats_does_not_end_the_store_s_silence() -> None:
    """A watch made again during the silence delivers the bucket's current values (the last beats, once more), then
    their expiry markers: the replay is no news, so the markers find the silence still on and remove nobody."""
    now = [100.0]
    beats: dict[str, bytes] = {}
    registry = Registry(ttl=5.0, clock=lambda: now[0])
    for i in range(2):
        info = WorkerInfo(
            worker_id=f"w{i}",
            region="r",
            capacity=Resources(cpus=4, memory_mb=4096),
            used=Resources(),
            heartbeat_at=100,
        )
        beats[f"r.w{i}"] = msgspec.json.encode(info)
        registry.apply(f"r.w{i}", beats[f"r.w{i}"])
    now[0] = 104.0  # silent for 4 s (past half the ttl)
    for key, beat in beats.items():
        registry.apply(key, beat)  # the new watch's current values: the same beats again
    now[0] = 104.1
    for key in beats:
        registry.apply(key, None)  # then their expiry markers
    assert registry.live_ids("r") == {"w0", "w1"}
    now[0] = 106.0  # past the ttl from the last real beat, still within the silence
    assert [w.worker_id for w in registry.workers()] == ["w0", "w1"]


def test_an_expiry_marker_after_the_silence_s_end_leaves_a_worker_its_ttl() -> None:
    """The new leader expires the beats from before the silence and takes the first new ones in either order: a
    marker that comes after another worker's first beat ends the silence does not remove a worker given a TTL
    then; that TTL judges it (gone if it does not beat within it)."""
    now = [100.0]
    registry = registry_of(2, lambda: now[0])
    now[0] = 104.0  # silent for 4 s
    back = WorkerInfo(
        worker_id="w0", region="r", capacity=Resources(cpus=4, memory_mb=4096), used=Resources(), heartbeat_at=104.0
    )
    registry.apply("r.w0", msgspec.json.encode(back))  # the silence ends: w1 gets a TTL from now
    now[0] = 104.1
    registry.apply("r.w1", None)  # its old beat's expiry marker, after the end
    assert registry.live_ids("r") == {"w0", "w1"}
    for second in (105.0, 106.0, 107.0, 108.0, 109.0, 109.5):  # w0 beats on; w1 never again
        now[0] = second
        registry.apply("r.w0", msgspec.json.encode(msgspec.structs.replace(back, heartbeat_at=second)))
    assert registry.live_ids("r") == {"w0"}  # w1: gone once its TTL from the silence's end has passed


def test_the_registry_sample_gives_up_on_a_region_too_small() -> None:
    registry = registry_of(3, lambda: 100.0)
    assert registry.sample("r", 2, random.Random(1), exclude={"w0"}) is None
    assert registry.sample("nowhere", 2, random.Random(1)) is None


def test_a_suspected_worker_is_gone_until_it_heartbeats_after_the_suspicion() -> None:
    now = [100.0]
    registry = registry_of(2, lambda: now[0])
    changed: list[str] = []
    registry.on_change = changed.append
    registry.suspect("w0")
    assert changed == ["w0"]
    assert not registry.is_live("w0") and registry.live_ids("r") == {"w1"}
    assert [w.worker_id for w in registry.workers("r")] == ["w1"]
    assert all(registry.sample("r", 1, random.Random(seed)) in (["w1"], None) for seed in range(20))

    def beat(at: float) -> None:
        info = WorkerInfo(
            worker_id="w0", region="r", capacity=Resources(cpus=4, memory_mb=4096), used=Resources(), heartbeat_at=at
        )
        registry.apply("r.w0", msgspec.json.encode(info))

    now[0] = 100.5
    beat(99.9)  # a heartbeat already in flight when it was suspected proves nothing
    assert not registry.is_live("w0")
    beat(100.4)  # one stamped after the suspicion does
    assert registry.is_live("w0") and registry.live_ids("r") == {"w0", "w1"}
    registry.suspect("w1")
    now[0] = 106.0  # the suspicion lasts one ttl; by then the heartbeat's age speaks for itself
    assert not registry.suspected("w1")


# --- property --------------------------------------------------------------------------------------


@st.composite
def offers(draw: st.DrawFn, worker_id: str) -> Offer | Decline:
    if draw(st.integers(0, 9)) == 0:
        return Decline(worker_id=worker_id, reason="cordoned")
    cpus = draw(st.integers(1, 64))
    memory_mb = draw(st.integers(1, 65536))
    return offer(
        worker_id,
        cpus=cpus,
        memory_mb=memory_mb,
        free_cpus=draw(st.integers(-1, cpus + 1)),
        free_mb=draw(st.integers(-1, memory_mb + 1)),
        region=draw(st.sampled_from(["mad", "mad", "mad", "ams"])),
        image_cached=draw(st.booleans()),
        load=draw(st.floats(0, 10)),
        app_machines=draw(st.integers(0, 5)),
    )


@st.composite
def auctions(draw: st.DrawFn) -> tuple[OfferRequest, list[Offer | Decline], set[str]]:
    workers = draw(st.lists(st.sampled_from([f"w{i}" for i in range(40)]), unique=True, max_size=30))
    replies = [draw(offers(w)) for w in workers]
    live = set(draw(st.lists(st.sampled_from([*workers, "x1", "x2"]), unique=True)))
    image = draw(st.none() | st.just("i"))
    req = request(cpus=draw(st.integers(1, 8)), memory_mb=draw(st.integers(1, 8192)), image=image)
    return req, replies, live


@settings(max_examples=200, deadline=None)
@given(auctions())
def test_candidates_fit_and_are_sorted_by_total(auction: tuple[OfferRequest, list[Offer | Decline], set[str]]) -> None:
    req, replies, live = auction
    ranking = rank(req, replies, live, CONFIG)
    by_id = {r.worker_id: r for r in replies}
    for candidate in ranking.candidates:
        reply = by_id[candidate.worker_id]
        assert isinstance(reply, Offer) and reply.region == req.region
        assert reply.free.cpus >= req.guest.cpus and reply.free.memory_mb >= req.guest.memory_mb
        assert candidate.free_after.cpus >= 0 and candidate.free_after.memory_mb >= 0
    totals = [c.total for c in ranking.candidates]
    assert totals == sorted(totals, reverse=True)
    explained = [w.worker_id for w in explain(ranking).workers]
    assert sorted(explained) == sorted(live | by_id.keys())


@st.composite
def asks(draw: st.DrawFn) -> Ask:
    """Asks with and without each rule the per-ask chain may leave out: avoid, away, a volume, a sandbox, an image."""
    some = st.lists(st.sampled_from(["w0", "w1", "w2", "x1"]), max_size=2)
    guest = Guest(
        cpus=draw(st.integers(1, 8)),
        memory_mb=draw(st.integers(1, 8192)),
        sandbox=draw(st.sampled_from(["none", "none", "bwrap"])),
    )
    return Ask(
        app="web",
        region="mad",
        guest=guest,
        image=draw(st.none() | st.just("i")),
        avoid=frozenset(draw(some)),
        away=frozenset(draw(some)),
        volume=draw(st.none() | st.sampled_from([("vol_a", "w1"), ("vol_b", "x1")])),
    )


@settings(max_examples=300, deadline=None)
@given(
    asks(),
    st.lists(st.sampled_from([f"w{i}" for i in range(6)]), unique=True).flatmap(
        lambda ids: st.tuples(*[offers(w) for w in ids])
    ),
)
def test_the_chain_kept_for_one_ask_judges_every_offer_as_the_whole_chain_does(
    ask: Ask, replies: tuple[Offer | Decline, ...]
) -> None:
    """`filters_for` and `scorers_for` only leave out filters and scorers that cannot matter for the ask (issue 44:
    the broker settles them once per auction): each verdict is the one the whole chain gives."""
    filters, scorers = filters_for(ask), scorers_for(ask)
    assert [name for name, _ in scorers] == [name for name, _ in SCORERS]
    for reply in replies:
        if isinstance(reply, Offer):
            reply = msgspec.structs.replace(reply, sandboxes=["bwrap"] if reply.load < 5 else [])
        assert judge(ask, reply, CONFIG, filters, scorers) == judge(ask, reply, CONFIG)
    assert len(filters_for(Ask.of(request()))) < len(FILTERS)  # a plain create leaves avoid, volume, sandbox out
