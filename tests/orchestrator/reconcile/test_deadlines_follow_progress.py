"""A deploy's wait for a machine ends for a reason: the machine is healthy, it failed, or `wait_timeout`
passed without progress. A worker still working (replacing, then starting, then started, each step slow on
a busy host) is waited for; one stuck in a state is not (docs/explanation/faults.md, "Deadlines that follow
progress").

Two files at a time, a rollback failed "not healthy within 6s: state replacing" while the worker was still
replacing the machine: the clock had run from the first look. Over the in-memory fleet and its fake clock,
so the slowness is the test's own (each step takes 4 s of a 5 s `wait_timeout`).
"""

from __future__ import annotations

from bus.contract.machines import Machine, UpdateRequest
from bus.contract.subjects import worker_machines
from orchestrator.reconcile import rollout
from tests.helpers import arun
from tests.orchestrator.reconcile.memory_fleet import FakeClock, MemoryFleet, MemoryWorker
from tests.orchestrator.reconcile.test_reconcile_unit import app_spec, fleet_of, version_of

STEP = 4.0  # seconds each of replacing and starting takes on this slow host: under wait_timeout, not both


def slow_updates(clock: FakeClock, fleet: MemoryFleet, *, stuck: bool = False) -> None:
    """Updates become replacing -> starting -> started, STEP seconds each (or replacing for good)."""
    since: dict[str, tuple[MemoryWorker, Machine, float]] = {}
    for worker in fleet.workers.values():

        def update(req: UpdateRequest, worker: MemoryWorker = worker) -> Machine:
            machine = worker._require(req.id, req.lease_nonce)
            machine.config = req.config
            since[machine.id] = (worker, machine, clock.now)
            return worker._run(machine, "replacing")

        fleet._routes[worker_machines(worker.worker_id, "update")] = update

    def move(now: float) -> None:
        for machine_id, (worker, machine, at) in list(since.items()):
            if stuck:
                continue
            if machine.state == "replacing" and now - at >= STEP:
                worker._run(machine, "starting")
            elif machine.state == "starting" and now - at >= 2 * STEP:
                worker._run(machine, "started")
                del since[machine_id]

    clock.listeners.append(move)


def test_a_machine_its_worker_is_still_replacing_and_starting_is_waited_for() -> None:
    clock, fleet, r = fleet_of(mad=2)
    assert arun(rollout.deploy(r, app_spec("mad = 1", wait="5s"))).ok
    slow_updates(clock, fleet)
    started = clock.now

    outcome = arun(rollout.deploy(r, app_spec("mad = 1", version="v2", wait="5s")))

    assert outcome.ok, outcome.message
    assert clock.now - started >= 2 * STEP  # longer than wait_timeout in all, and still waited for
    assert {version_of(m) for m in fleet.machines("web")} == {"v2"}


def test_a_machine_stuck_replacing_fails_the_deploy_at_wait_timeout() -> None:
    clock, fleet, r = fleet_of(mad=2)
    assert arun(rollout.deploy(r, app_spec("mad = 1", wait="5s"))).ok
    slow_updates(clock, fleet, stuck=True)

    outcome = arun(rollout.deploy(r, app_spec("mad = 1", version="v2", wait="5s")))

    assert not outcome.ok
    assert "not healthy within 5s" in outcome.message and "replacing" in outcome.message, outcome.message
