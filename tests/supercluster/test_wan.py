"""A create from another region crosses the WAN once each way (issue 40, "WAN between regions").

Two regions of one nats-server each, a worker and a broker per region, every gateway link through the relay with
30 ms one way (`bus.local.gateway_relay`: a propagation delay). The relay counts the messages that crossed between
the regions by subject, so the test counts the create's crossings rather than timing it. Before the region's own
create subject (`api.apps.<app>.machines.create.<region>`), such a create was answered by a broker of the caller's
region, whose auction asked the other region's workers across the WAN (offers, then reserve): at 30 ms one way the
offers' round trip alone passed the 50 ms deadline and the create failed, "no capacity".
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bus.contract import subjects
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats

ONE_WAY = 0.03  # seconds
INBOX = "_INBOX.wantest"  # the test client's replies, told apart from every other crossing by this prefix
SLEEP = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=16))


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    spec = FleetSpec(
        regions=["mad", "syd"], workers_per_region=1, supercluster=1, wan_delay=ONE_WAY, heartbeat=0.5, secure=False
    )
    with DevFleet(spec, progress=print) as running:
        yield running


def create_from(fleet: DevFleet, caller: str, region: str, app: str) -> tuple[Machine, dict[str, int]]:
    """A create (launched) into `region` from a client of `caller`'s server, and what crossed meanwhile."""
    assert fleet.supercluster is not None and fleet.supercluster.relay is not None
    relay = fleet.supercluster.relay

    async def go() -> Machine:
        nc = await connect_nats(fleet.region_url(caller), inbox_prefix=INBOX)
        try:
            client = FleetClient(nc)
            await client.workers()  # the connection's reply subscription is set up before counting starts
            relay.crossings.clear()
            return await client.create(app, CreateRequest(region=region, config=SLEEP))
        finally:
            await nc.close()

    machine = arun(go())
    return machine, dict(relay.crossings)


def test_a_create_from_another_region_crosses_the_wan_once_each_way(fleet: DevFleet) -> None:
    machine, crossed = create_from(fleet, "syd", "mad", "wan")
    assert (machine.region, machine.state) == ("mad", "started") and machine.worker_id.startswith("mad")
    request = subjects.api_machines_create_in("wan", "mad")
    replies = {subject: n for subject, n in crossed.items() if INBOX in subject}
    auction = {
        s: n for s, n in crossed.items() if s.startswith((f"{subjects.PREFIX}.offers.", f"{subjects.PREFIX}.worker."))
    }
    # one request there, one reply back; the auction (offers, reserve) stayed in mad
    assert crossed.get(request) == 1 and sum(replies.values()) == 1 and not auction, crossed


def test_a_region_s_own_create_crosses_nothing_on_its_way(fleet: DevFleet) -> None:
    machine, crossed = create_from(fleet, "mad", "mad", "own")
    assert (machine.region, machine.state) == ("mad", "started")
    on_the_way = {
        s: n for s, n in crossed.items() if INBOX in s or ".api." in s or s.startswith(f"{subjects.PREFIX}.worker.")
    }
    assert not on_the_way, crossed
