"""The create's own rules about workers are part of the chain: `avoid` a filter, `away` a scorer, both explained.

Before, `avoid_workers` was applied after ranking in the auction and `prefer_away` re-ran the whole auction
in the executor on a 503, invisible to `explain`.
"""

from __future__ import annotations

from bus.contract.fleet import CreateRequest, SimulateRequest
from bus.contract.machines import MachineConfig
from orchestrator.placement import PlacementConfig, explain, rank
from orchestrator.placement.ask import Ask
from tests.orchestrator.placement.test_placement import CONFIG, ids, offer, request


def test_avoided_workers_are_rejected_by_name() -> None:
    ranking = rank(Ask.of(request(), avoid={"a"}), [offer("a"), offer("b")], {"a", "b"}, CONFIG)
    assert ids(ranking) == ["b"]
    [rejected] = ranking.rejected
    assert (rejected.worker_id, rejected.filter) == ("a", "avoid")
    report = {w.worker_id: w for w in explain(ranking).workers}
    assert report["a"].outcome == "rejected" and "avoid_workers" in (report["a"].reason or "")


def test_away_is_a_penalty_that_loses_to_any_other_room_and_wins_over_none() -> None:
    # `a` is the better worker by far (an empty one is worse on the curves than a half-full one)
    replies = [offer("a", free_cpus=4), offer("b", free_cpus=8)]
    assert ids(rank(request(), replies, {"a", "b"}, CONFIG))[0] == "a"
    ranking = rank(Ask.of(request(), away={"a"}), replies, {"a", "b"}, CONFIG)
    assert ids(ranking) == ["b", "a"]
    assert ranking.candidates[1].subscores["away"] == -CONFIG.away_penalty
    assert ranking.candidates[0].subscores["away"] == 0.0
    # only the worker to stay away from has room: the order is still filled there
    alone = rank(Ask.of(request(), away={"a"}), [offer("a"), offer("b", free_cpus=0)], {"a", "b"}, CONFIG)
    assert ids(alone) == ["a"]


def test_the_away_penalty_is_configuration() -> None:
    config = PlacementConfig.from_mapping({"away_penalty": 0.0})
    replies = [offer("a", free_cpus=4), offer("b", free_cpus=8)]
    assert ids(rank(Ask.of(request(), away={"a"}), replies, {"a", "b"}, config))[0] == "a"


def test_a_sandboxed_machine_goes_only_where_the_sandbox_exists() -> None:
    from bus.contract.machines import Guest
    from bus.contract.offers import OfferRequest

    sandboxed = OfferRequest(app="web", region="mad", guest=Guest(sandbox="bwrap"))
    replies = [offer("plain"), offer("boxed", sandboxes=["bwrap"])]
    ranking = rank(sandboxed, replies, {"plain", "boxed"}, CONFIG)
    assert ids(ranking) == ["boxed"]
    [rejected] = ranking.rejected
    assert (rejected.worker_id, rejected.filter) == ("plain", "sandbox")
    assert "bubblewrap" in rejected.reason
    assert ids(rank(request(), replies, {"plain", "boxed"}, CONFIG)) != []  # no sandbox asked: both may take it


def test_a_create_s_ask_is_built_once_with_all_its_rules_and_the_chain_applies_them() -> None:
    """The placement rules travel as one `Ask` from the create to the chain (as Nomad's SelectOptions): built from
    the `CreateRequest` and the volume the broker found, and judged whole (no rule passed on the side)."""
    create = CreateRequest(
        region="mad",
        config=MachineConfig(cmd=["sleep", "1"]),
        avoid_workers=["a"],
        prefer_away=["b"],
        placement_preset="spread",
    )
    ask = Ask.for_create("web", create, ("vol_data", "c"))
    assert (ask.avoid, ask.away, ask.preset, ask.volume) == (
        frozenset({"a"}),
        frozenset({"b"}),
        "spread",
        ("vol_data", "c"),
    )
    assert ask.offer_request == request()  # the workers are asked the guest and image only: the rules stay here
    ranking = rank(ask, [offer("a"), offer("b"), offer("c"), offer("d")], {"a", "b", "c", "d"}, CONFIG)
    assert ids(ranking) == ["c"]
    assert {(r.worker_id, r.filter) for r in ranking.rejected} == {("a", "avoid"), ("b", "volume"), ("d", "volume")}
    simulated = Ask.for_simulate(SimulateRequest(app="web", region="mad", placement_preset="binpack"))
    assert (simulated.preset, simulated.avoid, simulated.volume) == ("binpack", frozenset(), None)
