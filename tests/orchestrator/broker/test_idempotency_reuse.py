"""An idempotency key names one request: the same key with a different request is a 409, not the old machine."""

from __future__ import annotations

import pytest

from bus.contract.errors import Conflict
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, fleet_fixture

fleet = fleet_fixture(FleetSpec(regions=["id"], workers_per_region=1, brokers=1))


def test_a_key_reused_with_another_request_is_a_conflict(fleet: DevFleet) -> None:
    async def main() -> None:
        client = await FleetClient.connect(fleet.url)
        try:
            config = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=64))
            first = await client.create(
                "keys", CreateRequest(region="id", config=config, skip_launch=True, idempotency_key="k-1")
            )
            same = await client.create(
                "keys", CreateRequest(region="id", config=config, skip_launch=True, idempotency_key="k-1", explain=True)
            )
            assert same.id == first.id  # how the answer is shown is not part of the request
            other = MachineConfig(cmd=["sleep", "61"], guest=Guest(cpus=1, memory_mb=64))
            with pytest.raises(Conflict, match="different request"):
                await client.create(
                    "keys", CreateRequest(region="id", config=other, skip_launch=True, idempotency_key="k-1")
                )
            assert [m.id for m in await client.list("keys")] == [first.id]
        finally:
            await client.close()

    arun(main())
