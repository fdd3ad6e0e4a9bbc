"""A client written against Fly's published spec drives the API unchanged but for its base URL.

bravado builds its client at run time from Fly's published Swagger 2.0 document (the contract in
`../shared/reference/`, kept as `tests/orchestrator/reference/fly-machines-openapi.json` so a clone anywhere
runs this test): the operations, their parameters and their models come from the spec alone, and every
response is validated against Fly's schemas. Real fleet, real API process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.orchestrator.test_api import start_api

pytestmark = pytest.mark.fleet  # starts a fleet of real processes (tests/conftest.py)

bravado_client = pytest.importorskip("bravado.client", reason="bravado (the dev extra) builds the Fly client")
SPEC = Path(__file__).resolve().parent / "reference" / "fly-machines-openapi.json"


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    if not SPEC.exists():
        pytest.skip(f"Fly's spec is not at {SPEC}")
    spec = FleetSpec(regions=["mad"], workers_per_region=1, cpus=4, memory_mb=4096, brokers=1)
    with DevFleet(spec) as fleet:
        proc, url = start_api(fleet.url)
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def fly_client(base: str) -> Any:
    spec = json.loads(SPEC.read_text())
    host = base.removeprefix("http://")
    spec.update(host=host, schemes=["http"])  # the one change: the base URL
    # Fly's document itself fails Swagger's meta-schema (a Go duration enum lists 1 and 1000 twice), so the
    # spec is not validated on load; requests and responses still are, against its schemas
    config = {
        "validate_swagger_spec": False,
        "validate_responses": True,
        "validate_requests": True,
        "use_models": False,
    }
    return bravado_client.SwaggerClient.from_spec(spec, origin_url=base, config=config)


def test_a_client_built_from_flys_spec_creates_waits_stops_and_destroys(base: str) -> None:
    fly = fly_client(base).Machines
    created = (
        fly.Machines_create(
            app_name="flyclient",
            request={
                "region": "mad",
                "config": {"init": {"cmd": ["sleep", "300"]}, "guest": {"cpus": 1, "memory_mb": 64}},
            },
        )
        .response()
        .result
    )
    machine_id = created["id"]
    assert created["config"]["init"]["cmd"] == ["sleep", "300"]
    fly.Machines_wait(app_name="flyclient", machine_id=machine_id, state="started", timeout=30).response()
    shown = fly.Machines_show(app_name="flyclient", machine_id=machine_id).response().result
    assert shown["state"] == "started"
    fly.Machines_stop(app_name="flyclient", machine_id=machine_id, request={}).response()
    fly.Machines_wait(app_name="flyclient", machine_id=machine_id, state="stopped", timeout=30).response()
    listed = fly.Machines_list(app_name="flyclient").response().result
    assert [m["id"] for m in listed] == [machine_id]
    fly.Machines_delete(app_name="flyclient", machine_id=machine_id).response()
    assert fly.Machines_list(app_name="flyclient").response().result == []
