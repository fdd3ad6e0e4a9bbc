"""The machine-readable contract: `fauxmad schema asyncapi` is a well-formed AsyncAPI 3.0 document whose
schemas are valid JSON Schema 2020-12, and what a real fleet sends validates against them: a create's
reply, a heartbeat, an event from the stream, an error reply, a list. `$SRV.INFO` names each endpoint's
channels. The document is checked by the reference AsyncAPI parser (npm's `@asyncapi/parser`, run by Node.js;
`.ci/run` installs it into tests/bus/asyncapi) and its structure by hand below; its schemas by the reference
JSON Schema validator, jsonschema."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import jsonschema
import msgspec
import pytest

from bus.contract import subjects
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.contract.schema import asyncapi, channels
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT, arun, connect_nats, fleet_fixture

fleet = fleet_fixture(FleetSpec(regions=["sch"], workers_per_region=1, cpus=4, memory_mb=2048))


def validator(doc: dict[str, Any], ref: dict[str, Any]) -> jsonschema.Draft202012Validator:
    schema = {**ref, "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


ASYNCAPI_CHECK = ROOT / "tests" / "bus" / "asyncapi"


@pytest.mark.fleet  # starts processes of its own
def test_the_reference_asyncapi_parser_accepts_the_document(tmp_path: Any) -> None:
    node = shutil.which("node")
    if node is None or not (ASYNCAPI_CHECK / "node_modules" / "@asyncapi" / "parser").is_dir():
        pytest.skip("the AsyncAPI parser is not installed: `npm ci --prefix tests/bus/asyncapi` (Node.js >= 18)")
    path = tmp_path / "asyncapi.json"
    path.write_text(json.dumps(asyncapi()))
    done = subprocess.run(
        [node, "check.mjs", str(path)], capture_output=True, text=True, cwd=ASYNCAPI_CHECK, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["channels"] == len(channels()) and found["operations"] == len(channels())
    assert f"{subjects.PREFIX}.worker.{{worker_id}}.machines.reserve" in found["addresses"]


@pytest.mark.fleet  # starts processes of its own
def test_the_document_is_asyncapi_3_and_every_schema_is_valid_json_schema() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "schema", "asyncapi"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc == json.loads(json.dumps(asyncapi()))
    assert doc["asyncapi"] == "3.0.0" and doc["info"]["title"] and doc["info"]["version"]
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)  # raises, naming the problem
    for name, channel in doc["channels"].items():
        assert channel["address"].startswith(subjects.PREFIX + "."), name
        params = set(channel.get("parameters", {}))
        assert params == {p.strip("{}") for p in channel["address"].split(".") if p.startswith("{")}, name
        for ref in channel["messages"].values():
            assert ref["$ref"].split("/")[-1] in doc["components"]["messages"]
        operation = doc["operations"][name]
        assert operation["channel"]["$ref"] == f"#/channels/{name}"
        for message in operation["messages"] + operation.get("reply", {}).get("messages", []):
            assert message["$ref"].split("/")[-1] in channel["messages"]
    verbs = {c.name for c in channels()}
    assert {"worker_machines_reserve", "api_machines_create", "api_machines_suspend", "events", "audit"} <= verbs


def test_what_a_real_fleet_sends_validates(fleet: DevFleet) -> None:
    doc = asyncapi()

    def reply_schema(channel: str) -> jsonschema.Draft202012Validator:
        message = doc["components"]["messages"][f"{channel}_reply"]
        return validator(doc, message["payload"])

    def payload_schema(channel: str) -> jsonschema.Draft202012Validator:
        return validator(doc, doc["components"]["messages"][f"{channel}_payload"]["payload"])

    async def main() -> dict[str, Any]:
        nc = await connect_nats(fleet.url)
        try:
            config = MachineConfig(cmd=["sleep", "30"], guest=Guest(cpus=1, memory_mb=32))
            create = CreateRequest(region="sch", config=config)
            payload_schema("api_machines_create").validate(msgspec.to_builtins(create))
            made = await nc.request(subjects.api_machines("schapp", "create"), msgspec.json.encode(create), timeout=30)
            listed = await nc.request(subjects.api_machines("schapp", "list"), b"{}", timeout=10)
            workers = await nc.request(subjects.API_WORKERS_LIST, b"{}", timeout=10)
            bad = await nc.request(subjects.api_machines("schapp", "create"), b'{"region": 5}', timeout=10)
            js = nc.jetstream()
            sub = await js.subscribe(subjects.events_filter("schapp"), ordered_consumer=True)
            event = await sub.next_msg(timeout=5)
            info = await nc.request("$SRV.INFO.fauxmad-worker", b"", timeout=5)
            return {
                "made": json.loads(made.data),
                "listed": json.loads(listed.data),
                "workers": json.loads(workers.data),
                "bad": (dict(bad.headers or {}), json.loads(bad.data)),
                "event": json.loads(event.data),
                "info": json.loads(info.data),
            }
        finally:
            await nc.close()

    seen = arun(main())
    reply_schema("api_machines_create").validate(seen["made"])
    reply_schema("api_machines_list").validate(seen["listed"])
    reply_schema("workers_list").validate(seen["workers"])
    payload_schema("events").validate(seen["event"])
    headers, body = seen["bad"]
    assert headers.get("Nats-Service-Error-Code") == "400"
    jsonschema.Draft202012Validator({"$ref": "#/components/schemas/ErrorBody", **doc}).validate(body)
    machines = next(e for e in seen["info"]["endpoints"] if e["name"] == "machines")
    assert machines["metadata"]["asyncapi"] == "fauxmad schema asyncapi"
    assert "worker_machines_reserve" in machines["metadata"]["channels"].split(",")
