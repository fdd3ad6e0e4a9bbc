"""A region cut off from the home region still comes up: a worker, a broker or a server restarted around the cut.

Found by the nemesis on hosts (seeds 103 and 105, a supercluster of one server a region). A worker restarted
while its region was cut off from the home region (which keeps the fleet-wide buckets and streams) exited with
`unexpected error: ServiceUnavailableError()`; a broker restarted just before a cut answered no create for the
whole cut. Nothing a region needs to place and serve its own machines lives at home, so each must work: a keyed
create asked of the cut-off region through its own servers is placed, on the region's own worker, and its list
shows it started, while the cut lasts. (Seed 105's findings, a region whose only server restarted just before
the cut and a broker restarted in the region that was then cut off, come from nats-server: see
docs/how-to/supercluster.md; the merged watch's part is tests/bus/test_merged_watch.py.)

Real parts: a dev supercluster of three regions (one nats-server each, gateways through relays that cut), a
worker and a broker per region; the restarted process is the fleet's own, started again with the same arguments.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun

HOME, CUT, OTHER = "mad", "syd", "gru"
APP = "cutoff"
WITHIN = 40.0  # seconds the cut-off region has to place and list the machine (the cut lasts until then)


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    spec = FleetSpec(
        regions=[HOME, CUT, OTHER],
        workers_per_region=1,
        cpus=8,
        memory_mb=4096,
        supercluster=1,
        brokers=1,
        heartbeat=0.5,
    )
    with DevFleet(spec, progress=print) as running:
        yield running


def placed_in_cut_region(fleet: DevFleet, key: str, region: str = CUT, within: float = WITHIN) -> tuple[str, str]:
    """A keyed create asked of `region` through its own servers (again, with the key, until it is
    answered), then its list until the machine shows started: (machine id, worker id), or AssertionError with
    the last error."""

    async def go() -> tuple[str, str]:
        deadline = time.monotonic() + within
        last = "nothing asked"
        client: FleetClient | None = None
        config = MachineConfig(cmd=["sleep", "600"], guest=Guest(cpus=1, memory_mb=16))
        try:
            while time.monotonic() < deadline:
                try:
                    if client is None:
                        client = await asyncio.wait_for(FleetClient.connect(fleet.region_url(region)), 5.0)
                        client.timeout = 5.0
                    request = CreateRequest(region=region, config=config, idempotency_key=key)
                    machine = await asyncio.wait_for(client.create(APP, request), 6.0)
                    found = await asyncio.wait_for(client.list(APP), 6.0)
                    if any(m.id == machine.id and m.state == "started" for m in found):
                        return machine.id, machine.worker_id
                    last = f"{machine.id} placed, not listed started yet"
                except Exception as exc:
                    last = f"{type(exc).__name__}: {exc}"[:300]
                await asyncio.sleep(0.5)
        finally:
            if client is not None:
                await client.close()
        raise AssertionError(f"{region}, cut off, placed nothing within {within:g}s: {last}")

    return arun(go())


def test_a_worker_restarted_in_a_cut_off_region_comes_up_and_places(fleet: DevFleet) -> None:
    assert fleet.supercluster is not None
    worker = f"worker-{CUT}-w1"
    fleet.kill(worker)
    fleet.supercluster.cut(CUT)
    try:
        fleet.respawn(worker)
        _, on = placed_in_cut_region(fleet, "restarted-worker")
        assert on == f"{CUT}-w1"
        proc = next(p for name, p in reversed(fleet.processes) if name == worker)
        assert proc.poll() is None, f"the restarted worker exited with {proc.returncode}"
    finally:
        fleet.supercluster.heal(CUT)
