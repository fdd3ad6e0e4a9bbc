"""`/openapi.json`, generated from the Structs that validate the requests (never written by hand), and `/docs`."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from orchestrator.api import types

_BODIES = [
    types.CreateMachineRequest,
    types.UpdateMachineRequest,
    types.StopRequest,
    types.SignalRequest,
    types.LeaseRequest,
    types.FlyMachine,
    types.ErrorResponse,
    types.CreateAppRequest,
    types.App,
    types.ListAppsResponse,
    types.MetadataValue,
    types.PlacementsRequest,
    types.PlacementsResponse,
]
_APP = {"name": "app_name", "in": "path", "required": True, "schema": {"type": "string"}}
_ID = {"name": "machine_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _op(summary: str, *, body: str | None = None, reply: str | None = None, params: list[Any] | None = None) -> Any:
    ref = {"$ref": f"#/components/schemas/{reply}"} if reply else {"type": "object"}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    op: dict[str, Any] = {
        "summary": summary,
        "parameters": params or [],
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": ref}}},
            "default": {"description": "error", "content": error},
        },
    }
    if body:
        schema = {"$ref": f"#/components/schemas/{body}"}
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": schema}}}
    return op


@cache
def document() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(_BODIES, ref_template="#/components/schemas/{name}")
    both = [_APP, _ID]
    m = "/v1/apps/{app_name}/machines"
    one = m + "/{machine_id}"
    wait_params = [
        *both,
        {"name": "state", "in": "query", "schema": {"type": "string", "enum": ["started", "stopped", "destroyed"]}},
        {"name": "timeout", "in": "query", "schema": {"type": "integer", "minimum": 0, "maximum": 60}},
        {"name": "instance_id", "in": "query", "schema": {"type": "string"}},
    ]
    key = {"name": "key", "in": "path", "required": True, "schema": {"type": "string"}}
    paths = {
        "/v1/apps": {
            "get": _op("List apps", reply="ListAppsResponse"),
            "post": _op("Create an app", body="CreateAppRequest", reply="App"),
        },
        "/v1/apps/{app_name}": {
            "get": _op("Get an app", reply="App", params=[_APP]),
            "delete": _op("Destroy an app's machines", params=[_APP]),
        },
        one + "/metadata": {"get": _op("A machine's metadata", params=both)},
        one + "/metadata/{key}": {
            "post": _op("Set a metadata key", body="MetadataValue", params=[*both, key]),
            "delete": _op("Remove a metadata key", params=[*both, key]),
        },
        "/v1/platform/placements": {
            "post": _op("Dry-run placement", body="PlacementsRequest", reply="PlacementsResponse"),
        },
        m: {
            "get": _op("List machines", params=[_APP]),
            "post": _op("Create a machine", body="CreateMachineRequest", reply="FlyMachine", params=[_APP]),
        },
        one: {
            "get": _op("Get a machine", reply="FlyMachine", params=both),
            "post": _op("Update a machine", body="UpdateMachineRequest", reply="FlyMachine", params=both),
            "delete": _op("Destroy a machine (?force=true or ?kill=true)", params=both),
        },
        one + "/start": {"post": _op("Start", params=both)},
        one + "/stop": {"post": _op("Stop", body="StopRequest", params=both)},
        one + "/restart": {"post": _op("Restart", params=both)},
        one + "/signal": {"post": _op("Signal", body="SignalRequest", params=both)},
        one + "/wait": {"get": _op("Wait for a state", params=wait_params)},
        one + "/events": {"get": _op("Events", params=both)},
        one + "/lease": {
            "get": _op("Get the lease", params=both),
            "post": _op("Acquire a lease", body="LeaseRequest", params=both),
            "delete": _op("Release a lease (fly-machine-lease-nonce header)", params=both),
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "fauxmad Machines API (Fly-compatible)", "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }


DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>fauxmad Machines API</title></head>
<body><h1>fauxmad Machines API</h1>
<p>Fly's Machines API paths under <code>/v1</code>, answered by fauxmad's brokers over NATS.
The machine-readable document is <a href="/openapi.json">/openapi.json</a>; the README's "HTTP API"
section lists what fauxmad adds (extensions) and what it leaves out.</p></body></html>
"""
