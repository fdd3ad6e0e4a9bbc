"""The operator outlives a nats-server restart: after a 2 s outage it still replaces a machine that goes away.

Found by a random fault run: `Reconciler.connect` connected with a command's settings (three reconnect
attempts a tenth of a second apart, nobody told when the connection closed), so after a nats-server outage of
a second or more `fauxmad reconcile --watch` stayed alive but deaf, logging `ConnectionClosedError` on every
pass and never again failing over, retiring or creating a machine. Real parts: a dev fleet (nats-server with
JetStream, two workers, a broker), an app deployed with `fauxmad deploy`, and the operator as it is run,
`fauxmad reconcile --watch`, as a subprocess. The server is SIGKILLed and started again on the same port and
store after two seconds; then one of the app's machines is destroyed on its worker, behind the operator's
back, and the operator must create another. And a connection the server closes for good ends the operator
with that reason (`reconcile --watch` exits non-zero with it) instead of leaving it looping deaf.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from bus.contract import subjects
from bus.contract.errors import Unreachable
from bus.contract.machines import DestroyRequest, Machine
from bus.local.embedded import EmbeddedNats
from bus.transport.connection import connect
from bus.transport.service import call
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.reconcile.over_nats import NatsBus
from orchestrator.reconcile.reconciler import Reconciler
from orchestrator.reconcile.watch import Operator
from tests.helpers import arun, fleet_fixture, start_operator, wait_until
from tests.orchestrator.reconcile.test_reconcile import fauxmad, machines, primaries, write_spec

REGION = "rst"
OUTAGE = 2.0  # seconds the nats-server is away: the fault itself, not a wait for anything


# a fleet of each test's own: its nats-server is killed and started again
fleet = fleet_fixture(
    FleetSpec(regions=[REGION], workers_per_region=2, cpus=4, memory_mb=2048, brokers=1), scope="function"
)


def running_primaries(fleet: DevFleet, app: str) -> list[Machine]:
    """The app's started primaries, or none while the fleet does not answer (it is coming back)."""
    try:
        return [m for m in primaries(machines(fleet, app)) if m.state == "started"]
    except Exception:
        return []


def both(found: list[Machine]) -> list[Machine]:
    """The two primaries, or none while a list lacks one (its worker still reconnecting)."""
    return found if len(found) == 2 else []


async def destroy_on_its_worker(fleet: DevFleet, machine: Machine) -> None:
    """Destroy `machine` with its worker's own verb: not through the API, nothing the operator did."""
    nc = await connect(fleet.url, "test-vandal")
    try:
        request = DestroyRequest(id=machine.id, force=True)
        await call(nc, subjects.worker_machines(machine.worker_id, "destroy"), request, Machine, timeout=10)
    finally:
        await nc.close()


def test_the_operator_still_replaces_a_lost_machine_after_a_nats_restart(fleet: DevFleet, tmp_path: Path) -> None:
    app = "deaf"
    spec = write_spec(tmp_path / "fauxmad.toml", app, regions=f"{REGION} = 2", spares=0)
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, app)
    try:
        assert fleet.nats is not None
        fleet.nats.kill()
        time.sleep(OUTAGE)  # the outage
        # started from this thread: the server's parent-death signal follows the thread that spawned it
        fleet.nats.start()
        # every worker answering again: a list while one is still reconnecting lacks its machines (a run of the
        # suite at two files at a time listed one of the two)
        before = wait_until(lambda: both(running_primaries(fleet, app)), "both primaries listed again", 30)
        victim = before[0]
        arun(destroy_on_its_worker(fleet, victim))

        def replaced() -> bool:
            now = running_primaries(fleet, app)
            return len(now) == 2 and victim.id not in {m.id for m in now}

        try:
            wait_until(replaced, f"the operator replacing {victim.id}", 45, interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; operator log:\n{log.read_text()[-3000:]}") from None
        assert operator.poll() is None, f"the operator exited:\n{log.read_text()[-3000:]}"
    finally:
        if operator.poll() is None:
            operator.send_signal(signal.SIGINT)
        code = operator.wait(20)
    text = log.read_text()
    assert code == 0, text[-3000:]
    # a NATS outage costs the operator a pass or two, never a storm of failed ones
    assert text.count("ConnectionClosedError") <= 3, text[-3000:]
    fauxmad(fleet, "apps", "destroy", app, "--yes")


def test_an_operator_whose_connection_the_server_closes_stops_saying_why(fresh_nats: EmbeddedNats) -> None:
    async def main() -> None:
        reconciler = await Reconciler.connect(fresh_nats.url)
        stop = asyncio.Event()
        watching = asyncio.create_task(Operator(reconciler).watch(None, stop))
        try:
            assert isinstance(reconciler.bus, NatsBus)
            # a control line over the server's 4 KiB limit: the server says -ERR and closes, and nats-py closes the
            # connection for good (no reconnect follows). Not an oversized publish: the server closed on it while
            # the client was still writing, the write failed first, and nats-py reconnected (CI, stop 53).
            await reconciler.bus.nc.subscribe("x" * 5000)
            with pytest.raises(Unreachable, match="lost NATS for good") as raised:
                await asyncio.wait_for(watching, 20)
            assert "closed" in raised.value.message
        finally:
            stop.set()
            await reconciler.close()

    arun(main())
