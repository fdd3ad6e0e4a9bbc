"""The planner, table-style: observed state in, actions out, with an injected clock. No I/O at all."""

from __future__ import annotations

import msgspec
import pytest

from orchestrator.apps.plan import (
    Create,
    Desired,
    Destroy,
    Member,
    Observed,
    Plan,
    Promote,
    Start,
    Stop,
    Update,
    plan,
)
from orchestrator.apps.spec import PRIMARY, RELEASE_KEY, REPLACES_KEY, ROLE_KEY, SPARE, AppSpec, parse_spec

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
) -> Plan:
    desired = Desired(app="web", release=release, spec=app_spec)
    observed = Observed(
        machines=tuple(machines),
        lost=tuple(lost or ()),
        cordoned=frozenset(cordoned or ()),
        unhealthy_since=since or {},
    )
    return plan(desired, observed, now)


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
    assert sorted((a.config.standbys[0], a.avoid_workers, a.start) for a in spares) == [
        ("a", ("w1",), False),
        ("b", ("w2",), False),
        ("c", ("s1",), False),
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
    assert "not healthy after 31s" in p.failures[0].reason


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
    assert [(type(a).__name__, a.avoid_workers) for a in p.actions if isinstance(a, Create)] == [("Create", ("w2",))]
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
    assert create.avoid_workers == ("w1",) and create.config.metadata[REPLACES_KEY] == "a"
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
