"""Pure decisions of the worker, table-style: lifecycle, restart policy, offers."""

from __future__ import annotations

import pytest

from bus.contract.errors import Conflict
from bus.contract.machines import RestartPolicy
from bus.contract.offers import OfferRequest, Resources
from workers.driver.base import ExitStatus, TaskState
from workers.lifecycle.restart_policy import Backoff, after_exit
from workers.lifecycle.resume import suspended_found
from workers.log.machine_states import LEGAL, check_transition
from workers.offers import Backpressure, Snapshot, answer_offer

OK = ExitStatus(exit_code=0)
CRASH = ExitStatus(exit_code=3)
OOM = ExitStatus(exit_code=None, signal=9, oom_killed=True)
BACKOFF = Backoff(base=0.5, factor=2, cap=4, stable_after=60)


@pytest.mark.parametrize(
    ("current", "target", "legal"),
    [
        ("created", "starting", True),
        ("created", "started", False),
        ("started", "stopping", True),
        ("stopped", "starting", True),
        ("destroyed", "starting", False),
        ("destroying", "destroyed", True),
        ("stopping", "starting", False),
    ],
)
def test_transition_table(current: str, target: str, legal: bool) -> None:
    if legal:
        check_transition("m", current, target)
    else:
        with pytest.raises(Conflict, match=f"is {current}; it cannot become {target}"):
            check_transition("m", current, target)


def test_every_state_in_the_table_is_reachable_from_created() -> None:
    seen, todo = {"created"}, ["created"]
    while todo:
        for nxt in LEGAL[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(LEGAL)


@pytest.mark.parametrize(
    ("policy", "status", "attempts", "ran_for", "restart", "state", "delay"),
    [
        (RestartPolicy(policy="no"), CRASH, 0, 1, False, "failed", 0),
        (RestartPolicy(policy="no"), OK, 0, 1, False, "stopped", 0),
        (RestartPolicy(policy="always"), OK, 0, 1, True, "starting", 0.5),
        (RestartPolicy(policy="always"), OK, 3, 1, True, "starting", 4.0),  # capped
        (RestartPolicy(policy="on-failure"), OK, 0, 1, False, "stopped", 0),
        (RestartPolicy(policy="on-failure", max_retries=2), CRASH, 1, 1, True, "starting", 1.0),
        (RestartPolicy(policy="on-failure", max_retries=2), CRASH, 2, 1, False, "failed", 0),
        (RestartPolicy(policy="on-failure", max_retries=2), CRASH, 2, 120, True, "starting", 0.5),  # stable run resets
        (RestartPolicy(policy="on-failure", max_retries=0), OOM, 0, 1, False, "failed", 0),
    ],
)
def test_after_exit(
    policy: RestartPolicy, status: ExitStatus, attempts: int, ran_for: float, restart: bool, state: str, delay: float
) -> None:
    decision = after_exit(policy, status, attempts=attempts, ran_for=ran_for, requested_stop=False, backoff=BACKOFF)
    assert (decision.restart, decision.state, decision.delay) == (restart, state, delay)


def test_requested_stop_never_restarts() -> None:
    decision = after_exit(
        RestartPolicy(policy="always"),
        ExitStatus(signal=15),
        attempts=0,
        ran_for=1,
        requested_stop=True,
        backoff=BACKOFF,
    )
    assert not decision.restart and decision.state == "stopped"


def _me(**overrides: object) -> Snapshot:
    values: dict[str, object] = dict(
        worker_id="w1",
        region="mad",
        capacity=Resources(cpus=4, memory_mb=1024),
        used=Resources(cpus=3, memory_mb=512),
        machines=3,
        cordoned=False,
        images=frozenset({"img:1"}),
        load=0.1,
        inflight=0,
    )
    values.update(overrides)
    return Snapshot(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("me", "guest", "reason"),
    [
        (_me(cordoned=True), {"cpus": 1}, "cordoned"),
        (_me(), {"cpus": 2}, "insufficient cpus"),
        (_me(), {"cpus": 1, "memory_mb": 600}, "insufficient memory"),
        (_me(inflight=64), {"cpus": 1}, "overloaded"),
        (_me(load=9.0), {"cpus": 1}, "overloaded"),
        (_me(), {"cpus": 1, "memory_mb": 512}, None),
    ],
)
def test_offers(me: Snapshot, guest: dict[str, int], reason: str | None) -> None:
    from bus.contract.machines import Guest

    reply = answer_offer(OfferRequest(app="a", region="mad", guest=Guest(**guest), image="img:1"), me, Backpressure())
    if reason is None:
        assert reply.__class__.__name__ == "Offer"
        assert reply.free == Resources(cpus=1, memory_mb=512) and reply.image_cached  # type: ignore[union-attr]
    else:
        assert reply.reason.startswith(reason)  # type: ignore[union-attr]


def test_a_max_load_of_zero_never_declines_for_load_but_still_ranks_by_it() -> None:
    from bus.contract.machines import Guest

    request = OfferRequest(app="a", region="mad", guest=Guest(cpus=1), image="img:1")
    reply = answer_offer(request, _me(load=40.0), Backpressure(max_load=0))
    assert reply.__class__.__name__ == "Offer" and reply.load == 40.0  # type: ignore[union-attr]
    assert answer_offer(request, _me(inflight=64), Backpressure(max_load=0)).reason.startswith("overloaded")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("task", "found"),
    [
        (TaskState(running=True, pid=10, stopped=True), "frozen"),
        (TaskState(running=True, pid=10, stopped=False), "resumed"),
        # ended between the worker's `recover` and its look: only its exit is recorded, not `started` first
        (TaskState(running=False, pid=10, stopped=False), "ended"),
        (TaskState(running=False, pid=10, stopped=True), "ended"),
    ],
)
def test_a_suspended_machine_on_restart(task: TaskState, found: str) -> None:
    assert suspended_found(task) == found
