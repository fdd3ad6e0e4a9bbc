"""One leg per create: a create that starts its machine sends the worker one request (reserve with launch).

A monitor subscription on the worker subjects (NATS delivers to every plain subscriber) counts what the
broker sends: before, a create+start was a `reserve` and then a `start` (two legs, three commits); now it
is one `reserve` with `launch` (two commits: `created`+`starting`, then `started`), answered `started`.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, fleet_fixture

CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))


fleet = fleet_fixture(FleetSpec(regions=["leg"], workers_per_region=2, cpus=8, memory_mb=8192, brokers=1))


def create_watching(fleet: DevFleet, request: CreateRequest) -> tuple[Machine, Counter[str], list[bool]]:
    async def main() -> tuple[Machine, Counter[str], list[bool]]:
        client = await FleetClient.connect(fleet.url)
        verbs: Counter[str] = Counter()
        launches: list[bool] = []

        async def seen(msg: object) -> None:
            subject: str = msg.subject  # type: ignore[attr-defined]
            verb = subject.rsplit(".", 1)[-1]
            verbs[verb] += 1
            if verb == "reserve":
                launches.append(bool(msgspec.json.decode(msg.data).get("launch")))  # type: ignore[attr-defined,unused-ignore]

        sub = await client.nc.subscribe("fauxmad.v1.worker.*.machines.>", cb=seen)
        try:
            machine = await client.create("leg", request)
            await asyncio.sleep(0.2)  # let the monitor's copies arrive
            return machine, verbs, launches
        finally:
            await sub.unsubscribe()
            await client.close()

    return arun(main())


def test_a_create_that_starts_is_one_request_to_the_worker(fleet: DevFleet) -> None:
    machine, verbs, launches = create_watching(fleet, CreateRequest(region="leg", config=CONFIG))
    assert machine.state == "started", machine.state
    assert verbs == Counter({"reserve": 1}) and launches == [True], verbs
    fleet.destroy_all_machines()


def test_the_machine_records_its_start_with_its_reservation(fleet: DevFleet) -> None:
    async def main() -> list[str]:
        client = await FleetClient.connect(fleet.url)
        try:
            created = await client.create("leg", CreateRequest(region="leg", config=CONFIG))
            got = await client.get("leg", created.id)
            assert isinstance(got.events, list)
            return [f"{e.status}:{e.reason}" for e in reversed(got.events)]
        finally:
            await client.close()

    history = arun(main())
    assert history[:3] == ["created:reserved", "starting:start requested", history[2]], history
    assert history[2].startswith("started:process "), history
    fleet.destroy_all_machines()


def test_a_reserve_only_create_does_not_launch(fleet: DevFleet) -> None:
    machine, verbs, launches = create_watching(fleet, CreateRequest(region="leg", config=CONFIG, skip_launch=True))
    assert machine.state == "created"
    assert verbs == Counter({"reserve": 1}) and launches == [False], verbs
    fleet.destroy_all_machines()


def test_a_hedged_create_reserves_two_and_starts_only_the_winner(fleet: DevFleet) -> None:
    machine, verbs, launches = create_watching(fleet, CreateRequest(region="leg", config=CONFIG, strategy="hedged"))
    assert machine.state == "started"
    assert verbs["reserve"] == 2 and verbs["start"] == 1 and launches == [False, False], verbs
    fleet.destroy_all_machines()
