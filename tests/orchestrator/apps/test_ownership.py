"""The rule the operator and the edge share (`reconcile.ownership`), table-style and without I/O: the planner
leaves what the edge stopped, suspended or created alone inside the range, and still replaces a lost host."""

from __future__ import annotations

import pytest

from orchestrator.apps.http_service import HttpService
from orchestrator.apps.ownership import region_range
from orchestrator.apps.spec import PRIMARY, SPARE, AppSpec, parse_spec
from orchestrator.proxy.choose import Candidate
from orchestrator.proxy.idle import idle_victims
from orchestrator.proxy.routes import App
from orchestrator.reconcile.actions import Create, Desired, Destroy, Member, Observed, Promote, Start, Stop
from orchestrator.reconcile.plan import plan

NOW = 1_000_000.0


def spec(
    regions: str = "mad = 3", service: str = 'auto_stop = "stop"\nmin_machines_running = 1', spares: int = 0
) -> AppSpec:
    return parse_spec(f"""
app = "web"
cmd = ["serve"]
[regions]
{regions}
[deploy]
spares = {spares}
[http_service]
{service}
""")


def m(
    id: str,
    worker: str,
    state: str,
    s: AppSpec,
    *,
    region: str = "mad",
    role: str = PRIMARY,
    standby_of: str | None = None,
) -> Member:
    return Member(
        id=id,
        region=region,
        worker_id=worker,
        state=state,
        config=s.machine_config(1, role, standby_of),
        healthy=state == "started",
        created_at=id,
    )


def actions(s: AppSpec, machines: list[Member], lost: list[Member] | None = None) -> list[object]:
    observed = Observed(machines=tuple(machines), lost=tuple(lost or ()))
    return list(plan(Desired(app="web", release=1, spec=s), observed, NOW).actions)


def test_machines_the_edge_stopped_or_suspended_stay_so_above_the_floor() -> None:
    s = spec()
    machines = [m("a", "w1", "started", s), m("b", "w2", "stopped", s), m("c", "w3", "suspended", s)]
    p = plan(Desired(app="web", release=1, spec=s), Observed(machines=tuple(machines)), NOW)
    assert p.actions == () and p.converged, p  # nothing started, nothing waited for


def test_below_the_floor_the_operator_starts_just_enough() -> None:
    s = spec(service='auto_stop = "stop"\nmin_machines_running = 2')
    machines = [m("a", "w1", "stopped", s), m("b", "w2", "stopped", s), m("c", "w3", "stopped", s)]
    starts = [a for a in actions(s, machines) if isinstance(a, Start)]
    assert [a.id for a in starts] == ["a", "b"]
    assert "runs 0 of the 2 kept running" in starts[0].reason


def test_without_auto_stop_every_resting_primary_is_started() -> None:
    s = spec(service='auto_stop = "off"')
    machines = [m("a", "w1", "stopped", s), m("b", "w2", "stopped", s), m("c", "w3", "started", s)]
    assert sorted(a.id for a in actions(s, machines) if isinstance(a, Start)) == ["a", "b"]


def test_what_the_edge_created_is_kept_up_to_max_per_region() -> None:
    s = spec(regions="mad = 0", service="auto_create = true\nmax_per_region = 2")
    two = [m("a", "w1", "started", s), m("b", "w2", "started", s)]
    assert actions(s, two) == []
    three = [*two, m("c", "w3", "started", s)]
    (destroy,) = actions(s, three)
    assert isinstance(destroy, Destroy) and "wants 0 (the edge may add up to 2), has 3" in destroy.reason


def test_without_auto_create_extras_go_as_before() -> None:
    s = spec(regions="mad = 1", service='auto_stop = "off"')
    (destroy,) = actions(s, [m("a", "w1", "started", s), m("b", "w2", "started", s)])
    assert isinstance(destroy, Destroy) and destroy.reason == "mad wants 1, has 2"


@pytest.mark.parametrize(("state", "starts"), [("stopped", False), ("suspended", False), ("started", True)])
def test_a_lost_host_is_still_covered_in_the_state_its_machine_was_in(state: str, starts: bool) -> None:
    s = spec(regions="mad = 2", spares=1, service='auto_stop = "stop"\nmin_machines_running = 0')
    lost = m("p", "dead", state, s)
    spare = m("sp", "w2", "stopped", s, role=SPARE, standby_of="p")
    (promote,) = [a for a in actions(s, [m("q", "w1", "stopped", s), spare], lost=[lost]) if isinstance(a, Promote)]
    assert (promote.id, promote.start) == ("sp", starts)
    alone = actions(s, [m("q", "w1", "stopped", s)], lost=[lost])
    (create,) = [a for a in alone if isinstance(a, Create) and a.made_by == "failover"]
    assert create.start is starts


def test_a_lost_stopped_primary_of_an_app_the_operator_runs_is_replaced_running() -> None:
    s = spec(regions="mad = 1", spares=1, service='auto_stop = "off"')
    spare = m("sp", "w2", "stopped", s, role=SPARE, standby_of="p")
    (promote,) = [a for a in actions(s, [spare], lost=[m("p", "dead", "stopped", s)]) if isinstance(a, Promote)]
    assert promote.start


def test_a_spare_the_edge_started_for_traffic_is_not_stopped_by_the_operator() -> None:
    s = spec(regions="mad = 1", spares=1, service='auto_stop = "stop"\nmin_machines_running = 0')
    machines = [m("p", "w1", "stopped", s), m("sp", "w2", "started", s, role=SPARE, standby_of="p")]
    assert not [a for a in actions(s, machines) if isinstance(a, Stop)]
    s_off = spec(regions="mad = 1", spares=1, service='auto_stop = "off"')
    machines = [m("p", "w1", "started", s_off), m("sp", "w2", "started", s_off, role=SPARE, standby_of="p")]
    assert [a.id for a in actions(s_off, machines) if isinstance(a, Stop)] == ["sp"]


@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("most", [1, 2, 5])
@pytest.mark.parametrize("auto_create", [True, False])
def test_the_edge_never_creates_what_the_operator_would_destroy(count: int, most: int, auto_create: bool) -> None:
    r = region_range(count, HttpService(auto_create=auto_create, max_per_region=most))
    for existing in range(8):
        if r.may_create(existing):
            assert r.too_many(existing + 1) == 0
    assert r.too_many(count) == 0  # the release's own count is always inside


@pytest.mark.parametrize("keep", [0, 1, 2, 4])
def test_the_edge_stops_down_to_the_floor_the_operator_keeps(keep: int) -> None:
    r = region_range(3, HttpService(auto_stop="stop", min_machines_running=keep))
    for running in range(5):
        left = running - r.to_stop(running)
        if r.to_stop(running):
            assert r.to_start(left, 3) == 0  # what the edge leaves running, the operator does not raise
        else:  # at or below the floor: the edge stops nothing, the operator raises it to the floor
            assert r.to_start(running, 3) == min(3, max(0, min(keep, 3) - running))


def test_idle_victims_keep_the_floor_in_each_region() -> None:
    app = App(name="web", service=HttpService(auto_stop="stop", min_machines_running=1), spec=spec("mad = 2\nsyd = 2"))
    machines = [Candidate(i, r, "started", 0) for i, r in (("a", "mad"), ("b", "mad"), ("c", "syd"), ("d", "syd"))]
    used = dict.fromkeys("abcd", 0.0)
    assert idle_victims(machines, used, 100.0, 60.0, app.may_stop, ["mad", "syd"]) == ["c", "a"]
