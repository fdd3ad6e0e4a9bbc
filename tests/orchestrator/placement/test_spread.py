"""Anti-affinity works: the machines of one app spread over a region's workers while there are free ones.

Before, workers never filled `app_machines` in their offers, so the spread scorer was always 0 and every
machine of an empty region went to its first worker.
"""

from __future__ import annotations

from collections import Counter

import pytest

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, fleet_fixture

CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))


fleet = fleet_fixture(FleetSpec(regions=["sp"], workers_per_region=4, cpus=4, memory_mb=4096, brokers=1))


@pytest.mark.parametrize("count", [2, 4])
def test_n_machines_of_an_app_land_on_n_workers(fleet: DevFleet, count: int) -> None:
    app = f"spread{count}"

    async def main() -> Counter[str]:
        client = await FleetClient.connect(fleet.url)
        try:
            placed = [
                await client.create(app, CreateRequest(region="sp", config=CONFIG, skip_launch=True, explain=True))
                for _ in range(count)
            ]
            return Counter(m.worker_id for m in placed)
        finally:
            await client.close()

    per_worker = arun(main())
    assert len(per_worker) == count, per_worker
    fleet.destroy_all_machines()


def test_the_offer_says_how_many_machines_of_the_app_a_worker_has(fleet: DevFleet) -> None:
    async def main() -> dict[str, int]:
        client = await FleetClient.connect(fleet.url)
        try:
            first = await client.create("counted", CreateRequest(region="sp", config=CONFIG, skip_launch=True))
            second = await client.create(
                "counted",
                CreateRequest(region="sp", config=CONFIG, skip_launch=True, explain=True, avoid_workers=[]),
            )
            workers = second.explain["workers"]  # type: ignore[index]
            return {w["worker_id"]: w["subscores"]["spread"] for w in workers if w.get("subscores")} | {
                "first": first.worker_id  # type: ignore[dict-item]
            }
        finally:
            await client.close()

    seen = arun(main())
    first = seen.pop("first")
    assert seen[first] < 0 and all(score == 0 for worker, score in seen.items() if worker != first), seen
    fleet.destroy_all_machines()
