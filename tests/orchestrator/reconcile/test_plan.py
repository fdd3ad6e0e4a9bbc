"""The planner, table-style: observed state in, actions out, with an injected clock. No I/O at all."""

from __future__ import annotations

import msgspec
import pytest

from bus.contract.errors import BadRequest, Conflict, DeadlineExceeded, NoCapacity
from bus.contract.fleet import CreateRequest, WorkerInfo
from bus.contract.machines import ExitInfo, MachineConfig
from bus.contract.offers import Resources
from orchestrator.apps.spec import PRIMARY, RELEASE_KEY, REPLACES_KEY, ROLE_KEY, SPARE, AppSpec, parse_spec
from orchestrator.reconcile.actions import (
    Create,
    Desired,
    Destroy,
    Failure,
    Member,
    Observed,
    Plan,
    Promote,
    Start,
    Stop,
    Update,
)
from orchestrator.reconcile.executor import Result
from orchestrator.reconcile.plan import plan, successors, summarize
from orchestrator.reconcile.preview import planned, problems, simulate
from orchestrator.reconcile.reconciler import Reconciler

NOW = 1_000_000.0


def spec(
    regions: str = "mad = 2", strategy: str = "rolling", spares: int = 0, max_unavailable: str = "1", env: str = "v1"
) -> AppSpec:
    return parse_spec(f"""
app = "web"
cmd = ["serve"]
env = {{ VERSION = "{env}" }}
[regions]
{regions}
[checks.alive]
type = "tcp"
[deploy]
strategy = "{strategy}"
spares = {spares}
max_unavailable = {max_unavailable}
wait_timeout = "30s"
""")


def m(
    id: str,
    worker: str,
    *,
    region: str = "mad",
    state: str = "started",
    role: str = PRIMARY,
    release: int = 1,
    app_spec: AppSpec | None = None,
    healthy: bool = True,
    standby_of: str | None = None,
    replaces: str | None = None,
    created: str = "",
) -> Member:
    config = (app_spec or spec()).machine_config(release, role, standby_of, replaces)
    return Member(
        id=id, region=region, worker_id=worker, state=state, config=config, healthy=healthy, created_at=created or id
    )


def run(
    app_spec: AppSpec | None,
    machines: list[Member],
    *,
    release: int = 1,
    lost: list[Member] | None = None,
    cordoned: set[str] | None = None,
    since: dict[str, float] | None = None,
    now: float = NOW,
    exits_since: float | None = None,
) -> Plan:
    desired = Desired(app="web", release=release, spec=app_spec)
    return plan(desired, observed(machines, lost=lost, cordoned=cordoned, since=since, exits_since=exits_since), now)


def observed(
    machines: list[Member],
    *,
    lost: list[Member] | None = None,
    cordoned: set[str] | None = None,
    since: dict[str, float] | None = None,
    exits_since: float | None = None,
) -> Observed:
    return Observed(
        machines=tuple(machines),
        lost=tuple(lost or ()),
        cordoned=frozenset(cordoned or ()),
        unhealthy_since=since or {},
        exits_since=exits_since,
    )


def kinds(p: Plan) -> list[tuple[str, str]]:
    return sorted((type(a).__name__, getattr(a, "id", "") or a.region) for a in p.actions)


def test_a_new_app_gets_primaries_and_spares_away_from_them() -> None:
    s = spec("mad = 2\nsyd = 1", spares=1)
    p = run(s, [])
    creates = [a for a in p.actions if isinstance(a, Create)]
    assert sorted((a.region, a.start) for a in creates) == [("mad", True), ("mad", True), ("syd", True)]
    assert all(a.config.metadata == {RELEASE_KEY: "1", ROLE_KEY: PRIMARY} for a in creates)
    assert not p.converged and not p.primaries_done
    # next pass: primaries exist; each gets one spare, never on its own worker
    p = run(s, [m("a", "w1"), m("b", "w2"), m("c", "s1", region="syd")])
    spares = [a for a in p.actions if isinstance(a, Create)]
    assert sorted((a.config.standbys[0], a.request.avoid_workers, a.start) for a in spares) == [
        ("a", ["w1"], False),
        ("b", ["w2"], False),
        ("c", ["s1"], False),
    ]
    assert all(a.config.metadata[ROLE_KEY] == SPARE for a in spares)
    assert p.primaries_done and not p.converged


def test_a_converged_app_plans_nothing() -> None:
    s = spec(spares=1)
    machines = [
        m("a", "w1"),
        m("b", "w2"),
        m("sa", "w2", role=SPARE, standby_of="a", state="created"),
        m("sb", "w3", role=SPARE, standby_of="b", state="stopped"),
    ]
    p = run(s, machines)
    assert p.actions == () and p.converged
    assert [(r.region, r.desired, r.ready, r.spares, r.spares_wanted) for r in p.regions] == [("mad", 2, 2, 2, 2)]


@pytest.mark.parametrize(
    ("max_unavailable", "in_flight", "updates"),
    [("1", 0, 1), ("2", 0, 2), ("0.5", 0, 2), ("1", 1, 0), ("2", 1, 1), ("1.0", 0, 4)],
)
def test_rolling_updates_as_many_as_the_budget_allows(max_unavailable: str, in_flight: int, updates: int) -> None:
    v2 = spec("mad = 4", max_unavailable=max_unavailable, env="v2")
    v1 = spec("mad = 4", env="v1")
    machines = [m(f"m{i}", f"w{i}", app_spec=v1) for i in range(4)]
    for i in range(in_flight):  # already on v2, not healthy yet
        machines[i] = m(f"m{i}", f"w{i}", app_spec=v2, release=2, healthy=False)
    p = run(v2, machines, release=2)
    done = [a for a in p.actions if isinstance(a, Update)]
    assert len(done) == updates
    assert all(a.restarts and a.config.env == {"VERSION": "v2"} for a in done)
    assert bool(p.waiting) == (updates < 4 or in_flight > 0)  # the rest wait their turn


def test_a_label_only_change_updates_in_place_outside_the_budget() -> None:
    s = spec("mad = 3", max_unavailable="1")
    machines = [m(f"m{i}", f"w{i}", release=1) for i in range(3)]
    p = run(s, machines, release=2)  # release 2 has the same config as release 1 (e.g. a scale or a rollback)
    assert len(p.actions) == 3
    assert all(isinstance(a, Update) and not a.restarts and a.config.metadata[RELEASE_KEY] == "2" for a in p.actions)


def test_a_machine_that_never_gets_healthy_fails_the_release_after_wait_timeout() -> None:
    s = spec("mad = 1", env="v2")
    bad = m("a", "w1", app_spec=s, release=2, healthy=False)
    p = run(s, [bad], release=2, since={"a": NOW - 10})
    assert not p.failures and p.unready == ("a",)
    p = run(s, [bad], release=2, since={"a": NOW - 31})
    assert [(f.region, f.machine_id) for f in p.failures] == [("mad", "a")]
    assert p.failures[0].reason == "not healthy within 30s" and p.failures[0].detail == "state started"


def test_immediate_updates_everything_at_once_without_waiting_for_health() -> None:
    v2 = spec("mad = 3", strategy="immediate", env="v2")
    p = run(v2, [m(f"m{i}", f"w{i}") for i in range(3)], release=2)
    assert len([a for a in p.actions if isinstance(a, Update)]) == 3
    p = run(
        v2,
        [m(f"m{i}", f"w{i}", app_spec=v2, release=2, healthy=False) for i in range(3)],
        release=2,
        since={f"m{i}": NOW - 999 for i in range(3)},
    )
    assert p.converged  # started is enough; no deadline


def test_canary_updates_one_machine_per_region_first() -> None:
    v1, v2 = (
        spec("mad = 3\nsyd = 3", env="v1"),
        spec("mad = 3\nsyd = 3", strategy="canary", max_unavailable="3", env="v2"),
    )
    machines = [m(f"{r}{i}", f"{r}-w{i}", region=r, app_spec=v1) for r in ("mad", "syd") for i in range(3)]
    p = run(v2, machines, release=2)
    assert sorted(a.region for a in p.actions if isinstance(a, Update)) == ["mad", "syd"]
    # the mad canary is healthy, the syd one is not yet: still one at a time everywhere
    machines[0] = m("mad0", "mad-w0", app_spec=v2, release=2)
    machines[3] = m("syd0", "syd-w0", region="syd", app_spec=v2, release=2, healthy=False)
    p = run(v2, machines, release=2)
    assert sorted(a.region for a in p.actions if isinstance(a, Update)) == ["mad"]
    machines[3] = m("syd0", "syd-w0", region="syd", app_spec=v2, release=2)
    p = run(v2, machines, release=2)
    assert sorted(a.region for a in p.actions if isinstance(a, Update)) == ["mad", "mad", "syd", "syd"]


def test_bluegreen_creates_green_and_destroys_blue_only_when_green_is_healthy_everywhere() -> None:
    v1, v2 = spec("mad = 2", env="v1"), spec("mad = 2", strategy="bluegreen", env="v2")
    blue = [m("b1", "w1", app_spec=v1), m("b2", "w2", app_spec=v1)]
    p = run(v2, blue, release=2)
    assert kinds(p) == [("Create", "mad"), ("Create", "mad")]
    green = [m("g1", "w3", app_spec=v2, release=2, healthy=False), m("g2", "w1", app_spec=v2, release=2)]
    p = run(v2, blue + green, release=2)
    assert not any(isinstance(a, Destroy) for a in p.actions) and p.waiting
    green[0] = m("g1", "w3", app_spec=v2, release=2)
    p = run(v2, blue + green, release=2)
    assert kinds(p) == [("Destroy", "b1"), ("Destroy", "b2")]


def test_a_lost_primary_is_taken_over_by_its_spare() -> None:
    s = spec("mad = 1", spares=1)
    lost = m("a", "w1")
    spare = m("sa", "w2", role=SPARE, standby_of="a", state="created")
    p = run(s, [spare], lost=[lost])
    assert len(p.actions) == 1 and isinstance(p.actions[0], Promote)
    promoted = p.actions[0].config
    assert promoted.metadata[ROLE_KEY] == PRIMARY and promoted.metadata[REPLACES_KEY] == "a"
    assert promoted.standbys == []
    # once promoted and running, a new spare is prepared (not on the promoted one's worker)
    now_primary = m("sa", "w2", replaces="a")
    p = run(s, [now_primary], lost=[lost])
    assert [(type(a).__name__, a.request.avoid_workers) for a in p.actions if isinstance(a, Create)] == [
        ("Create", ["w2"])
    ]
    assert not any(isinstance(a, Create) and a.start for a in p.actions)  # no second copy of the instance


def test_a_lost_primary_without_spare_is_replaced() -> None:
    p = run(spec("mad = 1"), [], lost=[m("a", "w1")])
    assert len(p.actions) == 1
    create = p.actions[0]
    assert isinstance(create, Create) and create.start and create.config.metadata[REPLACES_KEY] == "a"


def test_when_the_lost_worker_returns_the_replaced_machine_is_stopped_then_kept_as_a_spare() -> None:
    s = spec("mad = 1", spares=1)
    successor = m("sa", "w2", replaces="a")
    returned = m("a", "w1")  # its host came back and it runs again
    new_spare = m("s2", "w3", role=SPARE, standby_of="sa", state="created")
    p = run(s, [successor, returned, new_spare])
    assert kinds(p) == [("Stop", "a")]
    p = run(s, [successor, msgspec.structs.replace(returned, state="stopped"), new_spare])
    update = next(a for a in p.actions if isinstance(a, Update))
    assert update.id == "a" and not update.restarts
    assert update.config.metadata[ROLE_KEY] == SPARE and update.config.standbys == ["sa"]


def test_a_replaced_machine_keeps_running_until_its_successor_is_healthy() -> None:
    s = spec("mad = 1")
    p = run(s, [m("sa", "w2", replaces="a", healthy=False), m("a", "w1")])
    assert not any(isinstance(a, Stop | Destroy) for a in p.actions)
    assert any("to be healthy before a stops" in w for w in p.waiting)


def test_a_takeover_ends_once_the_replaced_machine_is_the_successors_spare() -> None:
    s = spec("mad = 1", spares=1)
    successor = m("sa", "w2", replaces="a")
    spare = m("a", "w1", role=SPARE, standby_of="sa", state="stopped")  # retired: kept as its spare
    p = run(s, [successor, spare])
    assert kinds(p) == [("Update", "sa")]
    update = p.actions[0]
    assert isinstance(update, Update) and not update.restarts
    assert REPLACES_KEY not in update.config.metadata and update.config.metadata[ROLE_KEY] == PRIMARY
    # so when the instance fails back (sa's host lost, its spare takes over), the two never name each other
    p = run(s, [m("a", "w1", replaces="sa"), m("sa", "w2")])
    assert kinds(p) == [("Create", "mad"), ("Stop", "sa")]  # sa is retired; a gets a spare
    assert not any(isinstance(a, Create) and a.start for a in p.actions)


def test_a_fail_back_whose_two_machines_name_each_other_keeps_exactly_one_running() -> None:
    """`a` took over from `sa` last (its instance is newer); `sa`'s claim on `a` is older, made before its host was
    lost. Before the fix both were stopped, each "replaced by" the other."""
    s = spec("mad = 1", spares=1)
    back = msgspec.structs.replace(m("sa", "w2", replaces="a"), instance_at=NOW - 60)
    taken_back = msgspec.structs.replace(m("a", "w1", replaces="sa"), instance_at=NOW - 5)
    p = run(s, [back, taken_back])
    stops = [a for a in p.actions if isinstance(a, Stop)]
    assert [(a.id, a.reason) for a in stops] == [("sa", "replaced by a")]
    assert not any(isinstance(a, Destroy) or (isinstance(a, Create) and a.start) for a in p.actions)
    # stopped, sa becomes a's spare (its own claim gone), then a's takeover ends: one primary, one spare
    p = run(s, [msgspec.structs.replace(back, state="stopped"), taken_back])
    demote = next(a for a in p.actions if isinstance(a, Update))
    assert demote.id == "sa" and demote.config.standbys == ["a"] and REPLACES_KEY not in demote.config.metadata
    assert not any(isinstance(a, Stop | Destroy) and a.id == "a" for a in p.actions)
    spare = m("sa", "w2", role=SPARE, standby_of="a", state="stopped")
    assert kinds(run(s, [spare, taken_back])) == [("Update", "a")]
    assert run(s, [spare, m("a", "w1")]).converged
    # whichever way round they are listed, and with instances that began together (by id then)
    assert successors([taken_back, back]) == {"sa": taken_back}
    tied = [m("b", "w1", replaces="c"), m("c", "w2", replaces="b")]
    assert successors(tied) == {"b": tied[1]}  # c, the higher id, stays; b is replaced by c
    assert successors(list(reversed(tied))) == {"b": tied[1]}


def test_a_cycle_of_three_claims_keeps_one_copy_running() -> None:
    s = spec("mad = 1", spares=1)
    ring = [
        msgspec.structs.replace(m("a", "w1", replaces="c"), instance_at=NOW - 1),  # the newest claim
        msgspec.structs.replace(m("b", "w2", replaces="a"), instance_at=NOW - 30),
        msgspec.structs.replace(m("c", "w3", replaces="b"), instance_at=NOW - 20),
    ]
    p = run(s, ring)
    assert sorted(a.id for a in p.actions if isinstance(a, Stop)) == ["b", "c"]
    assert not any(isinstance(a, Create) and a.start for a in p.actions)


def test_spares_in_the_wrong_place_are_fixed() -> None:
    s = spec("mad = 1", spares=1)
    primary = m("a", "w1")
    same_host = m("s1", "w1", role=SPARE, standby_of="a", state="created")
    p = run(s, [primary, same_host])
    assert ("Destroy", "s1") in kinds(p) and any(isinstance(a, Create) and not a.start for a in p.actions)
    running = m("s2", "w2", role=SPARE, standby_of="a", state="started")
    p = run(s, [primary, running])
    assert kinds(p) == [("Stop", "s2")]


def test_scaling_down_destroys_outdated_and_unhealthy_machines_first() -> None:
    s = spec("mad = 2")
    machines = [m("a", "w1"), m("b", "w2", healthy=False), m("c", "w3"), m("d", "w1", release=1)]
    p = run(s, machines, release=1)
    assert sorted(a.id for a in p.actions if isinstance(a, Destroy)) == ["b", "d"]


def test_a_primary_on_a_cordoned_worker_moves_healthy_first() -> None:
    s = spec("mad = 1")
    p = run(s, [m("a", "w1")], cordoned={"w1"})
    create = next(a for a in p.actions if isinstance(a, Create))
    assert create.request.avoid_workers == ["w1"] and create.config.metadata[REPLACES_KEY] == "a"
    moving = [m("a", "w1"), m("n", "w2", replaces="a", healthy=False)]
    assert not any(isinstance(a, Stop | Destroy) for a in run(s, moving, cordoned={"w1"}).actions)
    moving[1] = m("n", "w2", replaces="a")
    assert kinds(run(s, moving, cordoned={"w1"})) == [("Stop", "a")]
    moving[0] = m("a", "w1", state="stopped")
    assert kinds(run(s, moving, cordoned={"w1"})) == [("Destroy", "a")]


def test_destroying_an_app_destroys_everything_and_resting_primaries_are_started() -> None:
    machines = [m("a", "w1"), m("sa", "w2", role=SPARE, standby_of="a", state="created")]
    assert kinds(run(None, machines, release=0)) == [("Destroy", "a"), ("Destroy", "sa")]
    p = run(spec("mad = 1"), [m("a", "w1", state="stopped", healthy=False)])
    assert [type(a) for a in p.actions] == [Start]


def test_planning_is_deterministic() -> None:
    s = spec("mad = 3\nsyd = 2", spares=1)
    machines = [m("a", "w1"), m("b", "w2", healthy=False), m("sa", "w1", role=SPARE, standby_of="a", state="created")]
    assert run(s, machines) == run(s, list(reversed(machines)))


# ---------------------------------------------------------------------------------------------------
# a process that ends on its own during a deploy fails its region at once


def ended(at: float, code: int | None = 3, **fields: object) -> ExitInfo:
    return ExitInfo(exit_code=code, at=at, stderr_tail=["Traceback (most recent call last):", "", "KeyError: 'DB'"])


def crashed(member: Member, at: float, *, instance_at: float = NOW - 60, **fields: object) -> Member:
    info = msgspec.structs.replace(ended(at), **fields)
    return msgspec.structs.replace(member, exit=info, instance_at=instance_at, healthy=False)


@pytest.mark.parametrize("state", ["failed", "stopped", "starting", "started"])
def test_a_primary_that_exited_since_the_deploy_began_fails_at_once(state: str) -> None:
    s = spec("mad = 2", env="v2")
    bad = crashed(m("a", "w1", app_spec=s, release=2, state=state), at=NOW - 1)
    p = run(s, [bad, m("b", "w2", app_spec=s, release=2)], release=2, exits_since=NOW - 5)
    assert [(f.region, f.machine_id, f.reason) for f in p.failures] == [("mad", "a", "exited with code 3")]
    assert p.failures[0].detail == "Traceback (most recent call last): | KeyError: 'DB'"
    assert not any(isinstance(a, Start) for a in p.actions)  # starting it again would only crash again


@pytest.mark.parametrize(
    ("why", "fields", "instance_at", "exits_since"),
    [
        ("before the deploy began", {}, NOW - 60, NOW + 1),
        ("a previous instance's exit", {}, NOW, NOW - 5),
        ("a stop we asked for", {"requested_stop": True}, NOW - 60, NOW - 5),
        ("the worker was down", {"lost": True}, NOW - 60, NOW - 5),
        ("the operator, not a deploy", {}, NOW - 60, None),
    ],
)
def test_exits_that_do_not_fail_a_deploy(
    why: str, fields: dict[str, object], instance_at: float, exits_since: float | None
) -> None:
    s = spec("mad = 1")
    gone = crashed(m("a", "w1", state="stopped"), at=NOW - 1, instance_at=instance_at, **fields)
    p = run(s, [gone], exits_since=exits_since)
    assert not p.failures, why
    assert [type(a) for a in p.actions] == [Start]


def test_an_out_of_memory_kill_and_a_signal_say_so() -> None:
    s = spec("mad = 2")
    oom = crashed(m("a", "w1"), at=NOW, oom_killed=True, signal=9, exit_code=None, stderr_tail=[])
    killed = crashed(m("b", "w2"), at=NOW, signal=11, exit_code=None, stderr_tail=[])
    p = run(s, [oom, killed], exits_since=NOW - 5)
    assert sorted((f.machine_id, f.reason, f.detail) for f in p.failures) == [
        ("a", "was killed: out of memory", ""),
        ("b", "was killed by signal 11", ""),
    ]


def test_failures_are_one_line_per_distinct_error() -> None:
    same = "python3: can't open file '/srv/app.py': [Errno 2] No such file or directory"
    failures = [
        Failure(region=r, machine_id=f"{r}{i}", reason="exited with code 2", detail=same)
        for r in ("syd", "mad")
        for i in range(8)
    ]
    failures += [
        Failure(region="mad", machine_id="m9", reason="not healthy within 6s", detail="check http: refused :4001"),
        Failure(region="mad", machine_id="m8", reason="not healthy within 6s", detail="check http: refused :4002"),
        Failure(region="gru", machine_id="g1", reason="exited with code 2", detail="KeyError: 'DB'"),
        Failure(region="gru", machine_id="", reason="placing a new machine failed", detail="no capacity in gru"),
        Failure(region="gru", machine_id="", reason="placing a new machine failed", detail="no capacity in gru"),
    ]
    assert summarize(failures) == [
        f"mad, syd: 16 machines exited with code 2: {same}",
        "mad: 2 machines not healthy within 6s: check http: refused :4001",
        "gru: g1 exited with code 2: KeyError: 'DB'",
        "gru: placing a new machine failed (2 times): no capacity in gru",
    ]


# ---------------------------------------------------------------------------------------------------
# the dry run: the whole deploy simulated, and whether the fleet can take it


def steps_of(app_spec: AppSpec, machines: list[Member], release: int = 1) -> list[list[tuple[str, str]]]:
    steps = simulate(Desired(app="web", release=release, spec=app_spec), observed(machines), NOW)
    return [kinds(step) for step in steps]


def test_the_simulated_deploy_of_a_new_app_places_primaries_then_spares() -> None:
    steps = steps_of(spec("mad = 2\nsyd = 1", spares=1), [])
    assert steps == [[("Create", "mad"), ("Create", "mad"), ("Create", "syd")]] * 2
    actions = planned(Desired(app="web", release=1, spec=spec("mad = 1", spares=1)), observed([]), NOW)
    assert [(a.step, a.action, a.role, a.release, a.machine_id, a.from_release, a.starts) for a in actions] == [
        (1, "create", PRIMARY, 1, None, None, True),
        (2, "create", SPARE, 1, None, None, False),
    ]


def test_the_simulated_rolling_deploy_goes_in_batches_and_bluegreen_destroys_last() -> None:
    v1 = spec("mad = 3", env="v1")
    machines = [m(f"m{i}", f"w{i}", app_spec=v1) for i in range(3)]
    steps = steps_of(spec("mad = 3", env="v2", max_unavailable="1"), machines, release=2)
    assert steps == [[("Update", "m0")], [("Update", "m1")], [("Update", "m2")]]
    steps = steps_of(spec("mad = 3", env="v2", strategy="bluegreen"), machines, release=2)
    assert steps == [[("Create", "mad")] * 3, [("Destroy", "m0"), ("Destroy", "m1"), ("Destroy", "m2")]]
    unlabelled = Member(id="u", region="mad", worker_id="w1", state="started", config=MachineConfig(cmd=["x"]))
    [update] = planned(Desired(app="web", release=4, spec=spec("mad = 1")), observed([unlabelled]), NOW)
    assert (update.action, update.machine_id, update.from_release, update.from_role) == ("update", "u", None, None)
    assert (update.release, update.role, update.starts) == (4, PRIMARY, True)
    assert steps_of(spec("mad = 3", env="v1"), machines) == []  # converged: nothing to do


def worker(worker_id: str, region: str = "mad", *, cpus: int = 4, used: int = 0, cordoned: bool = False) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        region=region,
        capacity=Resources(cpus=cpus, memory_mb=4096),
        used=Resources(cpus=used, memory_mb=used * 256),
        cordoned=cordoned,
    )


def test_a_deploy_the_fleet_cannot_take_is_a_problem_before_anything_happens() -> None:
    s = spec("mad = 6\nsyd = 1\nlhr = 1\ngru = 0")
    steps = simulate(Desired(app="web", release=1, spec=s), observed([]), NOW)
    fleet = [worker("m1", used=3), worker("m2"), worker("m3", cordoned=True), worker("s1", "syd", cordoned=True)]
    assert problems(s, steps, fleet) == [
        "lhr: no live workers in lhr (regions with live workers: mad, syd)",
        "mad: room for 5 of the 6 new machines (1 cpus, 256 MB each) on 3 live workers",
        "syd: every worker of syd is cordoned (1)",
    ]
    assert problems(s, steps, [*fleet, worker("m4", cpus=1), worker("s2", "syd"), worker("l1", "lhr")]) == []
    # a region whose workers could not be read (its bucket did not answer) is not said to have none
    assert problems(s, steps, [*fleet, worker("m4", cpus=1), worker("s2", "syd")], frozenset({"lhr"})) == [
        "lhr: its workers could not be read: region lhr did not answer (try again shortly)"
    ]
    # machines already there need no room: only what the deploy must create counts
    running = [m(f"a{i}", "m2") for i in range(6)] + [m("s", "s2", region="syd"), m("l", "l1", region="lhr")]
    steps = simulate(Desired(app="web", release=1, spec=s), observed(running), NOW)
    assert problems(s, steps, [worker("m2", used=4), worker("s2", "syd", used=4), worker("l1", "lhr", used=4)]) == []


def test_a_refused_create_or_update_fails_at_once_but_a_busy_lease_or_a_spare_without_room_does_not() -> None:
    s = spec("mad = 1")
    primary = Create(request=CreateRequest(region="mad", config=s.machine_config(1, PRIMARY)))
    spare = Create(
        request=CreateRequest(region="mad", config=s.machine_config(1, SPARE, standby_of="a"), skip_launch=True)
    )
    update = Update(id="a", region="mad", worker_id="w1", config=s.machine_config(1, PRIMARY), restarts=True)
    results = [
        Result(
            action=primary, ok=False, error="config.workdir: /x is not a directory on worker w1", error_type=BadRequest
        ),
        Result(action=primary, ok=False, error="no capacity in mad", error_type=NoCapacity),
        Result(action=spare, ok=False, error="no capacity in mad", error_type=NoCapacity),
        Result(action=update, ok=False, machine_id="a", error="machine a: lease held by another", error_type=Conflict),
        Result(action=update, ok=False, machine_id="a", error="the worker did not answer", error_type=DeadlineExceeded),
        Result(action=update, ok=True, machine_id="a"),
    ]
    assert summarize(Reconciler._refused(results)) == [
        "mad: placing a new machine failed: config.workdir: /x is not a directory on worker w1",
        "mad: placing a new machine failed: no capacity in mad",
    ]
