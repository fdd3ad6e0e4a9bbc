"""A region whose workers all answer late is busy, not full: the create waits for the first offer (up to a
second, `orchestrator.broker.gather.FIRST_OFFER_PATIENCE`) rather than failing "no capacity ... no answer within
deadline". CI34 (four test files at a time on two cores) failed a create that way in a region of two live, idle
workers. Here the region's one worker is frozen (SIGSTOP) when the create is sent and thawed 300 ms later, six
times the auction's 50 ms deadline: before the change the create failed with 503; now the machine is made."""

from __future__ import annotations

import os
import signal
import threading

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, fleet_fixture

SLEEP = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=32))
FROZEN = 0.3  # seconds the worker stays frozen after the create is sent

fleet = fleet_fixture(FleetSpec(regions=["late"], workers_per_region=1, cpus=4, memory_mb=4096, brokers=1))


def test_a_create_waits_for_a_frozen_workers_late_offer_and_gets_its_machine(fleet: DevFleet) -> None:
    pid = next(proc.pid for name, proc in fleet.processes if name == "worker-late-w1" and proc.poll() is None)

    async def main() -> None:
        client = await FleetClient.connect(fleet.url)
        thaw = threading.Timer(FROZEN, os.kill, (pid, signal.SIGCONT))
        try:
            await client.create("slow", CreateRequest(region="late", config=SLEEP))  # warm: the broker knows it
            os.kill(pid, signal.SIGSTOP)
            thaw.start()
            made = await client.create("slow", CreateRequest(region="late", config=SLEEP))
            assert made.worker_id == "late-w1" and made.region == "late"
        finally:
            thaw.cancel()
            os.kill(pid, signal.SIGCONT)
            await client.close()

    arun(main())
