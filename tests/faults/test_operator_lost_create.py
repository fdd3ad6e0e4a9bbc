"""A create nobody answers must not hold the operator's other work: a stale primary back beside its promoted spare
is stopped while the create still waits.

In CI (torture on hosts, seed 11) a worker was killed, the operator promoted the spare and asked the brokers for a
new spare just as a nats-server restarted; that request was lost, and the operator's pass waited out its 35 s. The
killed worker came back meanwhile with the old primary still running (a worker leaves its machines running), and
two primaries ran in the region past the settle, until the create timed out and the next pass stopped the old one.

Here a subscriber in the brokers' queue group stands in for the brokers (the real one killed) and answers nothing:
every create is lost. The old primary must be stopped before the lost create's own wait (`caller_wait("create")`)
runs out, which the unfixed operator, its pass waiting on that create, never did.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from bus.contract import subjects
from bus.contract.deadlines import caller_wait
from bus.contract.machines import ListRequest, Machine
from bus.transport.service import call
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture, start_operator, until, wait_until
from tests.orchestrator.reconcile.test_reconcile import destroy, fauxmad, machines, role, spares, write_spec

fleet = fleet_fixture(FleetSpec(regions=["syd"], workers_per_region=2, cpus=4, memory_mb=4096, brokers=1))

OPERATOR_CREATE_WAIT = caller_wait("create", base=15.0)  # the operator's fleet client's base wait (reconciler.py)


async def listed(nc: Any, worker_id: str) -> list[Machine] | None:
    """The app's machines as the worker itself lists them (the brokers are the black hole); None if it does not
    answer."""
    try:
        return await call(nc, subjects.worker_machines(worker_id, "list"), ListRequest(app="ha"), list[Machine], 2.0)
    except Exception:
        return None


async def scenario(fleet: DevFleet, old_worker: str, old_id: str, spare_worker: str, spare_id: str) -> float:
    """Kill the old primary's worker (its machine goes on running), let the operator promote the spare while every
    create is lost, bring the worker back; return how long after the lost create the old primary stopped."""
    nc = await connect_nats(fleet.url)
    creates: list[float] = []

    async def black_hole(msg: Any) -> None:
        if ".machines.create." in msg.subject:
            creates.append(time.time())

    try:
        fleet.kill("broker-1")
        await nc.subscribe("fauxmad.v1.api.>", queue="brokers", cb=black_hole)
        fleet.kill(f"worker-{old_worker}")

        async def promoted() -> bool:
            found = await listed(nc, spare_worker) or []
            return any(m.id == spare_id and m.state == "started" and role(m) == "primary" for m in found)

        await until(promoted, "the spare promoted", 60)

        async def asked() -> bool:
            return bool(creates)

        await until(asked, "the operator asking for a new spare", 30)
        lost_at = creates[0]
        fleet.respawn(f"worker-{old_worker}")

        async def old_stopped() -> bool:
            found = await listed(nc, old_worker) or []
            return any(m.id == old_id and m.state != "started" for m in found)

        # the deadline is the contract's, not a speed: the lost create's own wait, less a margin for the last pass
        patience = lost_at + OPERATOR_CREATE_WAIT - 3 - time.time()
        await until(old_stopped, "the old primary stopped while the lost create waited", patience)
        return time.time() - lost_at
    finally:
        await nc.close()
        fleet.respawn("broker-1")


def test_a_lost_create_does_not_keep_a_stale_primary_running(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "ha", regions="syd = 1", spares=1)
    assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    wait_until(lambda: len(spares(machines(fleet, "ha"))) == 1, "the spare made", 20)
    found = machines(fleet, "ha")
    old = next(m for m in found if role(m) == "primary" and m.state == "started")
    spare = spares(found)[0]
    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, "ha")
    try:
        after = arun(scenario(fleet, old.worker_id, old.id, spare.worker_id, spare.id))
        print(f"\nthe old primary stopped {after:.1f}s after the lost create")
    finally:
        operator.send_signal(signal.SIGINT)
        try:
            operator.wait(20)
        except Exception:
            operator.kill()
            operator.wait()
        print(log.read_text())
    # the broker was started again on the way out of the scenario: its subscriptions come a moment after its spawn
    wait_until(lambda: fauxmad(fleet, "workers", "--json").returncode == 0, "the broker answering again", 30)
    destroy(fleet, "ha")
