"""A client written against Fly's published spec drives the API unchanged but for its base URL.

bravado builds its client at run time from Fly's published Swagger 2.0 document (the contract in
`../shared/reference/`, kept as `tests/orchestrator/api/reference/fly-machines-openapi.json` so a clone anywhere
runs this test): the operations, their parameters and their models come from the spec alone, and every
response is validated against Fly's schemas. Real fleet, real API process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.orchestrator.api.test_api import start_api

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.fleet  # starts a fleet of real processes (tests/conftest.py)

bravado_client = pytest.importorskip("bravado.client", reason="bravado (the dev extra) builds the Fly client")
SPEC = Path(__file__).resolve().parent / "reference" / "fly-machines-openapi.json"


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    if not SPEC.exists():
        pytest.skip(f"Fly's spec is not at {SPEC}")
    spec = FleetSpec(regions=["mad", "syd"], workers_per_region=1, cpus=4, memory_mb=4096, brokers=1)
    with DevFleet(spec) as running:
        yield running


@pytest.fixture(scope="module")
def base(fleet: DevFleet) -> Iterator[str]:
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


# ---------------------------------------------------------------------------------------------------
# the four differences a third-party client found (docs/reference/http-api.md, docs/fly-api-conformance.md)

SLEEP: dict[str, Any] = {"init": {"cmd": ["sleep", "300"]}, "guest": {"cpus": 1, "memory_mb": 64}}


def status_of(call: Any) -> int:
    """The HTTP status of a bravado call, error or not."""
    from bravado.exception import HTTPError

    try:
        return int(call.response().incoming_response.status_code)
    except HTTPError as exc:
        return int(exc.status_code)


def test_an_app_created_is_listed_and_a_deleted_app_is_gone(base: str) -> None:
    apps = fly_client(base).Apps
    assert status_of(apps.Apps_create(request={"app_name": "flyempty", "org_slug": "personal"})) == 201
    listed = apps.Apps_list(org_slug="personal").response().result
    assert "flyempty" in [a["name"] for a in listed["apps"]] and listed["total_apps"] == len(listed["apps"])
    assert "flyempty" not in [a["name"] for a in apps.Apps_list(org_slug="other-org").response().result["apps"]]
    shown = apps.Apps_show(app_name="flyempty").response().result
    assert (shown["name"], shown["status"], shown["organization"]["slug"]) == ("flyempty", "pending", "personal")
    assert status_of(apps.Apps_create(request={"app_name": "flyempty", "org_slug": "personal"})) == 409

    # with a machine: the delete destroys it, and then the app is gone for every call
    fly = fly_client(base).Machines
    fly.Machines_create(app_name="flyempty", request={"region": "mad", "config": SLEEP}).response()
    assert status_of(apps.Apps_delete(app_name="flyempty")) == 202
    assert status_of(apps.Apps_show(app_name="flyempty")) == 404
    assert "flyempty" not in [a["name"] for a in apps.Apps_list(org_slug="personal").response().result["apps"]]
    assert fly.Machines_list(app_name="flyempty").response().result == []
    assert status_of(apps.Apps_delete(app_name="flyempty")) == 404
    assert status_of(apps.Apps_show(app_name="neverapp")) == 404


def test_the_list_filters_region_include_deleted_state_and_summary(base: str) -> None:
    fly = fly_client(base).Machines
    made = {
        region: fly.Machines_create(app_name="flyfilter", request={"region": region, "config": SLEEP})
        .response()
        .result["id"]
        for region in ("mad", "syd")
    }
    syd = fly.Machines_list(app_name="flyfilter", region="syd").response().result
    assert [m["id"] for m in syd] == [made["syd"]]
    assert fly.Machines_list(app_name="flyfilter", region="gru").response().result == []
    fly.Machines_delete(app_name="flyfilter", machine_id=made["syd"], force=True).response()
    assert [m["id"] for m in fly.Machines_list(app_name="flyfilter").response().result] == [made["mad"]]
    with_deleted = fly.Machines_list(app_name="flyfilter", include_deleted=True).response().result
    assert {m["id"]: m["state"] for m in with_deleted} == {made["mad"]: "started", made["syd"]: "destroyed"}

    # `state` and `summary` are newer than the reference spec: the client cannot send them, plain HTTP does
    def get(query: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"{base}/v1/apps/flyfilter/machines?{query}", timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    assert [m["id"] for m in get("state=destroyed")[1]] == [made["syd"]]
    assert [m["id"] for m in get("state=started,destroyed&region=mad")[1]] == [made["mad"]]
    summary = get("summary=true")[1]
    assert [m["id"] for m in summary] == [made["mad"]] and "config" not in summary[0] and "events" not in summary[0]
    assert get("state=sleeping")[0] == 400 and "invalid state 'sleeping'" in get("state=sleeping")[1]["error"]
    assert get("include_deleted=maybe")[0] == 400
    fly.Machines_delete(app_name="flyfilter", machine_id=made["mad"], force=True).response()


def sent_back(sent: Any, got: Any, where: str = "config") -> None:
    """Every field `sent` comes back in `got` with the value sent (a dict may gain defaults, never lose one)."""
    if isinstance(sent, dict):
        assert isinstance(got, dict), f"{where}: sent an object, got {got!r}"
        for key, value in sent.items():
            assert key in got, f"{where}.{key} was sent and did not come back: {got!r}"
            sent_back(value, got[key], f"{where}.{key}")
    else:
        assert got == sent, f"{where}: sent {sent!r}, got {got!r}"


def test_the_config_a_client_sends_comes_back_with_defaults_filled_in(
    base: str, fleet: DevFleet, tmp_path: Path
) -> None:
    source = tmp_path / "img"
    source.mkdir()
    (source / "run.sh").write_text("exec sleep 300\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAUXMAD_NATS_URL": fleet.url}
    built = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "image", "build", str(source), "--tag", "roundtrip:v1", "--json"],
        capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=60,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    digest = json.loads(built.stdout)["digest"]
    fly = fly_client(base).Machines
    configs: list[dict[str, Any]] = [
        {  # every default given explicitly: the issue's `cpus: 1` among them
            "init": {"cmd": ["sleep", "300"]},
            "guest": {"cpus": 1, "memory_mb": 128, "cpu_kind": "shared"},
            "env": {"GREETING": "hola", "EMPTY": ""},
            "metadata": {"team": "sandwiches"},
            "restart": {"policy": "on-failure", "max_retries": 3},
            "auto_destroy": False,
        },
        {"init": {"entrypoint": ["sh", "-c"], "cmd": ["exec sleep 300"]}, "restart": {"policy": "no"}},
        {"init": {"exec": ["sleep", "301"]}, "guest": {"cpus": 2, "memory_mb": 96, "cpu_kind": "performance"}},
        {"image": "roundtrip:v1", "init": {"cmd": ["sh", "run.sh"]}, "env": {"A": "1"}},
    ]
    for config in configs:
        created = fly.Machines_create(app_name="flyconfig", request={"region": "mad", "config": config})
        machine = created.response().result
        sent_back(config, machine["config"])
        shown = fly.Machines_show(app_name="flyconfig", machine_id=machine["id"]).response().result
        sent_back(config, shown["config"])
        if "image" in config:
            sent_back({"repository": "roundtrip", "tag": "v1", "digest": digest}, shown["image_ref"], "image_ref")
        # a read-modify-write, as Fly's clients update: what was read goes back, and comes back unchanged
        updated = (
            fly.Machines_update(app_name="flyconfig", machine_id=machine["id"], request={"config": shown["config"]})
            .response()
            .result
        )
        sent_back(config, updated["config"])
        sent_back(shown["config"], updated["config"])
        fly.Machines_delete(app_name="flyconfig", machine_id=machine["id"], force=True).response()
    # nothing but a command sent: every default is said (as read off the wire: bravado fills absent fields with None)
    defaults = fly.Machines_create(
        app_name="flyconfig", request={"region": "mad", "config": {"init": {"cmd": ["sleep", "300"]}}}
    )
    made = defaults.response().result["id"]
    with urllib.request.urlopen(f"{base}/v1/apps/flyconfig/machines/{made}", timeout=30) as resp:
        filled = json.loads(resp.read())["config"]
    assert filled["guest"] == {"cpus": 1, "memory_mb": 256, "cpu_kind": "shared"}
    assert filled["restart"] == {"policy": "on-failure"} and filled["auto_destroy"] is False
    assert (filled["env"], filled["metadata"], filled["mounts"], filled["init"]) == (
        {},
        {},
        [],
        {"cmd": ["sleep", "300"]},
    )
    fly.Machines_delete(app_name="flyconfig", machine_id=made, force=True).response()


def test_what_is_not_supported_is_a_501_and_restart_takes_its_timeout(base: str) -> None:
    fly = fly_client(base).Machines
    made = fly.Machines_create(app_name="flyrest", request={"region": "mad", "config": SLEEP}).response().result
    one = f"{base}/v1/apps/flyrest/machines/{made['id']}"

    def call(method: str, url: str, data: bytes | None = None) -> tuple[int, Any]:
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    for method, url in [("POST", one + "/exec"), ("GET", one + "/ps"), ("GET", one + "/versions")]:
        status, answer = call(method, url, b"{}" if method == "POST" else None)
        assert status == 501 and "not supported" in answer["error"], (url, answer)
    status, answer = call("POST", f"{base}/v1/apps/flyrest/volumes/vol_0123456789abcdef", b"{}")
    assert status == 501 and "not supported" in answer["error"]
    assert call("POST", one + "/restart?timeout=soon")[0] == 400
    # `sleep` dies of SIGTERM at once; the timeout (a Go duration or seconds) is accepted either way
    assert call("POST", one + "/restart?timeout=2s")[0] == 200
    assert call("POST", one + "/restart?timeout=3")[0] == 200
    fly.Machines_delete(app_name="flyrest", machine_id=made["id"], force=True).response()
