"""Placement with shared or no scatters, and per-app presets, on a real fleet (NATS, worker and broker processes).

- A burst of creates shares one scatter (explain's `shared`), and still spreads: the broker discounts what it
  picked from the offers in hand, so a burst does not herd to the best worker.
- `replica` asks nobody: it ranks the workers' heartbeats, discounted the same way, and respects a cordon.
- `placement_preset` (fauxmad.toml's `[placement] preset`) changes the curves: `spread` puts machines of
  different apps on different workers, `binpack` on one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from bus.contract import subjects
from bus.contract.fleet import CordonRequest, CreateRequest, WorkerInfo
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.transport.service import call
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, fleet_fixture

CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))
WORKERS = 4


fleet = fleet_fixture(FleetSpec(regions=["sp"], workers_per_region=WORKERS, cpus=8, memory_mb=8192, brokers=1))


def create(app: str, **options: object) -> CreateRequest:
    return CreateRequest(region="sp", config=CONFIG, skip_launch=True, explain=True, **options)  # type: ignore[arg-type]


def test_a_burst_shares_a_scatter_and_still_spreads(fleet: DevFleet) -> None:
    async def main() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return list(await asyncio.gather(*[client.create("burst", create("burst")) for _ in range(WORKERS)]))
        finally:
            await client.close()

    placed = arun(main())
    assert len({m.worker_id for m in placed}) == WORKERS, [m.worker_id for m in placed]
    shared = [m.explain["shared"] for m in placed]  # type: ignore[index]
    assert max(shared) > 1, shared  # four creates at once: at least two answered by one scatter
    fleet.destroy_all_machines()


def test_replica_places_without_asking_and_spreads(fleet: DevFleet) -> None:
    async def main() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return [await client.create("copy", create("copy", strategy="replica")) for _ in range(WORKERS)]
        finally:
            await client.close()

    placed = arun(main())
    assert len({m.worker_id for m in placed}) == WORKERS, [m.worker_id for m in placed]
    for machine in placed:
        assert machine.explain["strategy"] == "replica" and machine.explain["asked"] == 0  # type: ignore[index]
    fleet.destroy_all_machines()


def test_replica_never_places_on_a_cordoned_worker(fleet: DevFleet) -> None:
    cordoned = fleet.worker_ids[0]

    async def main() -> Counter[str]:
        client = await FleetClient.connect(fleet.url)
        try:
            await call(client.nc, subjects.worker_cordon(cordoned, True), CordonRequest(reason="test"), WorkerInfo)
            deadline = time.perf_counter() + 10
            while not any(w.cordoned for w in await client.workers("sp") if w.worker_id == cordoned):
                assert time.perf_counter() < deadline, "the broker's replica never saw the cordon"
                await asyncio.sleep(0.05)
            placed = [await client.create("avoid", create("avoid", strategy="replica")) for _ in range(6)]
            return Counter(m.worker_id for m in placed)
        finally:
            await call(client.nc, subjects.worker_cordon(cordoned, False), CordonRequest(reason="test"), WorkerInfo)
            await client.close()

    per_worker = arun(main())
    assert cordoned not in per_worker and sum(per_worker.values()) == 6, per_worker
    fleet.destroy_all_machines()


@pytest.mark.parametrize(("preset", "workers"), [("spread", 3), ("binpack", 1)])
def test_a_preset_changes_where_machines_of_different_apps_land(fleet: DevFleet, preset: str, workers: int) -> None:
    async def main() -> set[str]:
        client = await FleetClient.connect(fleet.url)
        try:
            placed = [
                await client.create(f"{preset}{i}", create(f"{preset}{i}", placement_preset=preset)) for i in range(3)
            ]
            return {m.worker_id for m in placed}
        finally:
            await client.close()

    used = arun(main())
    assert len(used) == workers, used
    fleet.destroy_all_machines()
