"""`fauxmad machine restart` holds the machine's lease from its stop to its start, as the HTTP API's restart does
(orchestrator/restart.py, shared by both): an operator that sees the machine stopped in between cannot lease it
first and make the restart's start a 409. Without the shared lease this test's wait for a lease never ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from bus.contract.errors import Conflict
from bus.contract.machines import Lease, LeaseRequest, Machine
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT, arun, fauxmad, fleet_fixture, running, wait_until

APP = "restarted"
REGION = "mad"

pytestmark = pytest.mark.fleet


fleet = fleet_fixture(FleetSpec(regions=[REGION], workers_per_region=1, cpus=4, memory_mb=2048))


async def _machine(url: str, machine_id: str) -> Machine:
    client = await FleetClient.connect(url)
    try:
        return await client.get(APP, machine_id)
    finally:
        await client.close()


async def _operator_leases(url: str, machine_id: str) -> Lease:
    client = await FleetClient.connect(url)
    try:
        request = LeaseRequest(id=machine_id, ttl=15, holder="an operator")
        return await client.asker(APP)("lease", request, Lease)
    finally:
        await client.close()


def test_a_cli_restart_holds_the_lease_from_its_stop_to_its_start(fleet: DevFleet) -> None:
    # it ignores SIGTERM (sleep is exec'd after the trap), so the stop lasts its whole 3 s timeout
    token = f"300.{os.getpid()}{threading.get_ident() % 100000}"
    run = fauxmad("machine", "run", "--app", APP, "--region", REGION, "--json", "--",
                  "sh", "-c", f"trap '' TERM; exec sleep {token}", url=fleet.url)  # fmt: skip
    assert run.returncode == 0, run.stderr
    mid = json.loads(run.stdout)["id"]
    wait_until(lambda: running(["sleep", token]), "the machine's sleep runs")
    env = dict(os.environ, PYTHONPATH=str(ROOT), FAUXMAD_NATS_URL=fleet.url)
    argv = [sys.executable, "-m", "orchestrator.cli", "machine", "restart", mid, "--app", APP, "--stop-timeout", "3"]
    restart = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lease = wait_until(lambda: arun(_machine(fleet.url, mid)).lease, "the restart's lease", timeout=20)
        assert lease is not None and lease.holder == "a restart through the CLI"
        with pytest.raises(Conflict, match="leased by a restart through the CLI"):
            arun(_operator_leases(fleet.url, mid))
    finally:
        _, err = restart.communicate(timeout=120)
    assert restart.returncode == 0, err
    after = arun(_machine(fleet.url, mid))
    assert after.state == "started" and after.lease is None  # released at its end
    assert fauxmad("machine", "destroy", mid, "--app", APP, "--force", url=fleet.url).returncode == 0
