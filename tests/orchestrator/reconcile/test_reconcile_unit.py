"""The reconciler end to end over its ports: observe -> plan -> execute against an in-memory fleet.

No nats-server and no sleeping: the fleet, the release store and the clock are the in-memory ones of
`memory_fleet`, the loop polls with a zero timeout, and deadlines are reached by the fake clock moving
as the loop reads it. The same paths over real NATS and real workers are the edges in `test_reconcile`.
"""

from __future__ import annotations

import msgspec
import pytest

from bus.contract.errors import Conflict
from bus.contract.machines import Lease, LeaseRequest, Machine
from bus.contract.subjects import worker_machines
from orchestrator.apps.releases import Head, Release, Releases, WatchedReleases
from orchestrator.apps.spec import RELEASE_KEY, REPLACES_KEY, ROLE_KEY, SPARE, AppSpec, PlacementSpec
from orchestrator.reconcile import rollout
from orchestrator.reconcile.actions import Desired
from orchestrator.reconcile.executor import Result
from orchestrator.reconcile.observe import health
from orchestrator.reconcile.reconciler import Reconciler
from orchestrator.reconcile.watch import Operator
from tests.helpers import arun
from tests.orchestrator.reconcile.memory_fleet import FakeClock, MemoryFleet, MemoryStore
from tests.orchestrator.reconcile.test_plan import spec as plan_spec


def app_spec(regions: str = "mad = 2", version: str = "v1", spares: int = 0, wait: str = "30s") -> AppSpec:
    """The planner tests' app (one tcp check, rolling one machine at a time), with its own health deadline."""
    made = plan_spec(regions, spares=spares, env=version)
    return msgspec.structs.replace(made, deploy=msgspec.structs.replace(made.deploy, wait_timeout=wait))


def fleet_of(**regions: int) -> tuple[FakeClock, MemoryFleet, Reconciler]:
    clock = FakeClock()
    fleet = MemoryFleet(clock)
    for region, count in regions.items():
        for n in range(1, count + 1):
            fleet.add_worker(f"{region}{n}", region)
    reconciler = Reconciler(fleet, fleet, MemoryStore(), clock=clock, timer=clock, poll=0, backstop=0, debounce=0)
    fleet.follow(reconciler.observer.registry, reconciler.observer.index)
    return clock, fleet, reconciler


def version_of(machine: Machine) -> str:
    return machine.config.env["VERSION"]


def test_a_first_deploy_places_every_primary_on_its_own_worker_and_completes_the_release() -> None:
    _, fleet, r = fleet_of(mad=3, ams=2)

    outcome = arun(rollout.deploy(r, app_spec("mad = 2\nams = 2")))

    assert outcome.ok, outcome.message
    assert outcome.message == "v1 deployed"
    machines = fleet.machines("web")
    assert sorted(m.region for m in machines) == ["ams", "ams", "mad", "mad"]
    assert all(health(m)[0] and m.config.metadata[RELEASE_KEY] == "1" for m in machines)
    assert len({m.worker_id for m in machines}) == 4  # one region's creates in turn: they spread
    assert {c.placement_preset for c in fleet.creates} == {None}  # no [placement]: the brokers' own curves
    assert arun(r.releases.current("web")).status == "complete"  # type: ignore[union-attr]


def test_deploying_the_same_spec_again_changes_nothing() -> None:
    _, fleet, r = fleet_of(mad=2)
    arun(rollout.deploy(r, app_spec()))
    creates = len(fleet.creates)

    again = arun(rollout.deploy(r, app_spec()))

    assert again.ok and not again.changed
    assert again.message == "already at v1: nothing to change"
    assert len(fleet.creates) == creates
    assert [rel.version for rel in arun(r.releases.list("web"))] == [1]


def test_a_rolling_update_moves_every_machine_to_the_new_release_and_returns_every_lease() -> None:
    _, fleet, r = fleet_of(mad=3)
    arun(rollout.deploy(r, app_spec("mad = 3")))

    outcome = arun(rollout.deploy(r, app_spec("mad = 3", version="v2")))

    assert outcome.ok, outcome.message
    machines = fleet.machines("web")
    assert len(machines) == 3
    assert {version_of(m) for m in machines} == {"v2"}
    assert {m.config.metadata[RELEASE_KEY] for m in machines} == {"2"}
    assert all(m.lease is None for w in fleet.workers.values() for m in w.machines.values())
    assert [(rel.version, rel.status) for rel in arun(r.releases.list("web"))] == [(1, "complete"), (2, "complete")]


def test_a_release_that_never_gets_healthy_fails_by_the_clock_and_rolls_back() -> None:
    clock, fleet, r = fleet_of(mad=2)
    arun(rollout.deploy(r, app_spec(wait="5s")))
    fleet.healthy = lambda config: config.env.get("VERSION") != "v2"
    started = clock.now

    outcome = arun(rollout.deploy(r, app_spec(version="v2", wait="5s")))

    assert not outcome.ok
    assert outcome.rolled_back_to == 1
    assert "rolled back to v1 in every region (mad)" in outcome.message
    assert clock.now - started >= 5.0  # the deadline came from the injected clock, not from waiting
    assert {version_of(m) for m in fleet.machines("web")} == {"v1"}
    assert all(health(m)[0] for m in fleet.machines("web"))
    failed = arun(r.releases.get("web", 2))
    assert failed.status == "failed" and failed.reason


def test_a_lost_worker_s_primary_is_replaced_from_the_routing_index() -> None:
    _, fleet, r = fleet_of(mad=3)
    arun(rollout.deploy(r, app_spec()))
    gone = fleet.machines("web")[0]
    fleet.lose(gone.worker_id)

    observed = arun(r.observer.observe("web", ["mad"]))
    assert [m.id for m in observed.lost] == [gone.id]  # nobody to ask: the index remembers it

    result = arun(rollout.reconcile_once(r, "web"))

    assert result.ok, result.describe()
    live = [m for m in fleet.machines("web") if not fleet.workers[m.worker_id].lost]
    assert len(live) == 2 and all(health(m)[0] for m in live)
    assert [m.config.metadata.get(REPLACES_KEY) for m in live].count(gone.id) == 1
    assert gone.worker_id not in {m.worker_id for m in live}


def test_spares_are_placed_off_their_primary_s_worker_and_left_unstarted() -> None:
    _, fleet, r = fleet_of(mad=3)
    spec = app_spec(spares=1)
    release = arun(rollout.begin(r, spec))

    converged = arun(
        r.converge(Desired(app="web", release=release.version, spec=spec), timeout=60, until="all"),
    )

    assert converged.ok, converged.describe()
    machines = {m.id: m for m in fleet.machines("web")}
    spares = [m for m in machines.values() if m.config.metadata[ROLE_KEY] == SPARE]
    assert len(spares) == 2
    for spare in spares:
        primary = machines[spare.config.standbys[0]]
        assert spare.state == "created" and spare.worker_id != primary.worker_id
    assert all(c.avoid_workers for c in fleet.creates if c.config.metadata[ROLE_KEY] == SPARE)


def test_the_spec_s_placement_preset_goes_with_every_create() -> None:
    _, fleet, r = fleet_of(mad=3)
    spec = msgspec.structs.replace(app_spec(spares=1), placement=PlacementSpec(preset="binpack"))
    release = arun(rollout.begin(r, spec))

    converged = arun(r.converge(Desired(app="web", release=release.version, spec=spec), timeout=60, until="all"))

    assert converged.ok, converged.describe()
    roles = sorted(c.config.metadata[ROLE_KEY] for c in fleet.creates)
    assert roles == ["primary", "primary", "spare", "spare"]
    assert {c.placement_preset for c in fleet.creates} == {"binpack"}


def test_a_machine_leased_by_another_reconciler_is_left_to_a_later_pass() -> None:
    _, fleet, r = fleet_of(mad=2)
    arun(rollout.deploy(r, app_spec()))
    held = fleet.machines("web")[0]
    other = LeaseRequest(id=held.id, ttl=2.0, holder="someone else")
    arun(fleet.call(worker_machines(held.worker_id, "lease"), other, Lease, timeout=5))
    refused: list[Result] = []
    r.on_result = lambda app, result: refused.append(result) if result.failed_with(Conflict) else None

    outcome = arun(rollout.deploy(r, app_spec(version="v2")))

    assert outcome.ok, outcome.message
    assert refused and refused[0].machine_id == held.id  # a 409, not retried by the executor...
    assert {version_of(m) for m in fleet.machines("web")} == {"v2"}  # ...but planned again once the lease ran out


def test_a_deploy_the_fleet_has_no_room_for_touches_nothing() -> None:
    clock, fleet, r = fleet_of(mad=1)
    fleet.workers["mad1"].slots = 1
    fleet.beat(clock.now)  # its next heartbeat says so

    with pytest.raises(rollout.CannotDeploy, match="mad: room for 1 of the 2 new machines"):
        arun(rollout.deploy(r, app_spec()))

    assert fleet.creates == [] and arun(r.releases.list("web")) == []


def test_two_deployers_never_claim_one_release_number() -> None:
    clock, store = FakeClock(), MemoryStore()
    first, second = Releases(store, clock=clock), Releases(store, clock=clock)

    one = arun(first.create(app_spec(), "deploy"))
    two = arun(second.create(app_spec(version="v2"), "deploy"))

    assert (one.version, two.version) == (1, 2)
    assert arun(first.get("web", 2)).spec.env["VERSION"] == "v2"


def test_the_apps_watch_keeps_heads_and_releases_for_when_the_bucket_does_not_answer() -> None:
    watched = WatchedReleases()
    release = Release(app="web", version=2, spec=app_spec())
    watched.apply("web.releases.2", msgspec.json.encode(release))
    watched.apply("web.current", msgspec.json.encode(Head(app="web", version=2)))
    watched.apply("web.releases.x", b"{}")  # not a release key: ignored
    watched.apply("api.current", b"not json")  # a value that does not decode: ignored
    assert watched.apps() == {"web"}
    assert watched.head("web") == Head(app="web", version=2)
    assert watched.release("web", 2) == release
    watched.apply("web.current", None)  # deleted or purged
    assert watched.head("web") is None and watched.apps() == {"web"}  # its release is still there
    watched.apply("web.releases.2", None)
    assert watched.apps() == set()


def test_an_operator_leaves_an_app_to_the_deploy_that_claims_it_until_the_claim_goes_or_lapses() -> None:
    clock, fleet, deployer = fleet_of(mad=2)
    operator = Reconciler(fleet, fleet, deployer.releases.kv, clock=clock, timer=clock, poll=0, backstop=0, debounce=0)
    operator.executor.holder = "the operator"
    fleet.follow(operator.observer.registry, operator.observer.index)
    watching = Operator(operator)

    release = arun(rollout.begin(deployer, app_spec("mad = 2")))  # claimed before `current` names the release
    assert arun(watching._claimed("web"))
    assert fleet.machines("web") == []

    outcome = arun(rollout.finish(deployer, release))  # holds the claim while it converges, then lets go
    assert outcome.ok, outcome.message
    assert arun(deployer.releases.claim_of("web")) is None
    assert not arun(watching._claimed("web"))

    arun(deployer.releases.claim("web", "a deploy killed halfway", 2, rollout.CLAIM_TTL))
    assert arun(watching._claimed("web"))
    clock.now += rollout.CLAIM_TTL
    assert not arun(watching._claimed("web"))  # lapsed: the operator takes the app up again


def test_a_regions_operator_leaves_alone_an_app_that_runs_only_elsewhere() -> None:
    """A supercluster runs an operator per region. An app with no count in a region is nothing of that region's
    operator: its pass makes no plan and fails nothing (it used to fail every pass making a spec with no region,
    and the operator looked again at its fastest poll for as long as the app existed), while the operator of
    the app's own region still replaces a machine that went."""
    clock, fleet, deployer = fleet_of(mad=2, gru=2)
    outcome = arun(rollout.deploy(deployer, app_spec("mad = 1")))
    assert outcome.ok, outcome.message
    desired = arun(deployer.desired("web"))
    assert desired is not None

    def regions_operator(region: str) -> Reconciler:
        operator = Reconciler(
            fleet, fleet, deployer.releases.kv, clock=clock, timer=clock, poll=0, backstop=0, debounce=0, region=region
        )
        fleet.follow(operator.observer.registry, operator.observer.index)
        return operator

    plan, results = arun(regions_operator("gru").step(desired))
    assert plan.converged and results == []

    (only,) = fleet.machines("web")
    arun(fleet.destroy("web", only.id, force=True))
    plan, _ = arun(regions_operator("mad").step(desired))
    assert [type(a).__name__ for a in plan.actions] == ["Create"], plan


def test_a_deploy_asks_a_live_worker_that_did_not_answer_again_and_a_loop_pass_does_not() -> None:
    """A worker back from a cut beats before it answers again: a deploy's first look asks it again while it is
    live (`ONE_SHOT_PATIENCE`), where an operator's pass fails and looks again at its next poll."""
    from bus.contract.errors import Unanswered

    _, fleet, r = fleet_of(mad=2)
    arun(rollout.deploy(r, app_spec()))
    silent = fleet.machines("web")[0].worker_id
    answered = fleet.call
    misses = {"left": 0}

    async def call(subject: str, request: msgspec.Struct, reply: type, *, timeout: float) -> object:
        if subject == worker_machines(silent, "list") and misses["left"]:
            misses["left"] -= 1
            raise Unanswered(f"no answer on {subject} within {timeout:g}s")
        return await answered(subject, request, reply, timeout=timeout)

    fleet.call = call  # type: ignore[method-assign]
    misses["left"] = 1
    with pytest.raises(Unanswered):
        arun(r.observer.observe("web", ["mad"]))
    misses["left"] = 2
    shown = arun(rollout.preview(r, app_spec(version="v2")))
    assert misses["left"] == 0 and len([a for a in shown.actions]) > 0


def test_a_deploys_patience_is_measured_on_the_observers_clock_and_ends() -> None:
    """A live worker that never answers is asked again until the patience is used up, by the observer's clock
    (injected: no wall time passes here), and then the pass fails with its silence."""
    from bus.contract.errors import Unanswered

    _, fleet, r = fleet_of(mad=2)
    arun(rollout.deploy(r, app_spec()))
    silent = fleet.machines("web")[0].worker_id
    answered = fleet.call
    asked = {"times": 0}
    now = {"t": 100.0}

    async def call(subject: str, request: msgspec.Struct, reply: type, *, timeout: float) -> object:
        if subject == worker_machines(silent, "list"):
            asked["times"] += 1
            now["t"] += timeout  # each asking waits its timeout, on the observer's clock
            raise Unanswered(f"no answer on {subject} within {timeout:g}s")
        return await answered(subject, request, reply, timeout=timeout)

    fleet.call = call  # type: ignore[method-assign]
    r.observer.clock = lambda: now["t"]
    with pytest.raises(Unanswered):
        arun(r.observer.observe("web", ["mad"], patience=3 * r.observer.answer_within))
    assert asked["times"] == 3  # each waited one timeout: the third ended the patience
