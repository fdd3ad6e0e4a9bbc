"""The worker's verb tables: every verb of the contract has its method, and a table that disagrees with the
contract stops the worker at start (mypy checks each method's request type; these check the verbs)."""

from __future__ import annotations

from typing import Any

import pytest

from bus.contract.base import Request
from bus.contract.machines import StartRequest, StopRequest
from bus.contract.streams import LogLine
from bus.contract.verbs import WORKER_REQUESTS, WORKER_VOLUME_REQUESTS
from workers.agent.routes import checked, machine_routes, route, volume_routes
from workers.lifecycle.manager import MachineManager
from workers.output import LogFollower
from workers.volumes.verbs import VolumeManager


async def _publish(line: LogLine) -> None:
    pass


async def _answer(request: Any) -> None:
    pass


def test_every_verb_of_the_contract_has_its_route() -> None:
    manager = object.__new__(MachineManager)  # only its bound methods are looked at
    follower = LogFollower(_publish, region="r", worker_id="w")
    machines = machine_routes(manager, follower)
    assert {verb: r.kind for verb, r in machines.items()} == WORKER_REQUESTS
    volumes = volume_routes(object.__new__(VolumeManager))
    assert {verb: r.kind for verb, r in volumes.items()} == WORKER_VOLUME_REQUESTS


def test_a_table_that_disagrees_with_the_contract_is_refused() -> None:
    contract: dict[str, type[Request]] = {"start": StartRequest, "stop": StopRequest}
    assert checked("machines", {"start": route(StartRequest, _answer), "stop": route(StopRequest, _answer)}, contract)
    with pytest.raises(TypeError, match="no route for 'stop'"):
        checked("machines", {"start": route(StartRequest, _answer)}, contract)
    with pytest.raises(TypeError, match="'halt' is not a verb of the contract"):
        checked(
            "machines",
            {**{v: route(k, _answer) for v, k in contract.items()}, "halt": route(StopRequest, _answer)},
            contract,
        )
    with pytest.raises(TypeError, match="'stop' takes StartRequest, the contract says StopRequest"):
        checked("machines", {"start": route(StartRequest, _answer), "stop": route(StartRequest, _answer)}, contract)
