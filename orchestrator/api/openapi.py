"""`/openapi.json`, generated from the Structs that validate the requests (never written by hand), and `/docs`."""

from __future__ import annotations

from functools import cache
from typing import Any, get_args

import msgspec

from bus.contract.base import TOKEN_PATTERN, VOLUME_ID_PATTERN, State
from bus.contract.volumes import Volume, VolumeSnapshot
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
    types.CreateVolumeRequest,
    types.ExtendVolumeRequest,
    types.ExtendVolumeResponse,
    Volume,
    VolumeSnapshot,
]
_BY_NAME: dict[str, Any] = {kind.__name__: kind for kind in _BODIES}
_NONCE = {
    "name": "fly-machine-lease-nonce",
    "in": "header",
    "required": True,
    "schema": {"type": "string", "minLength": 1},
}
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_APP = {
    "name": "app_name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": TOKEN_PATTERN},
}
_ID = {"name": "machine_id", "in": "path", "required": True, "schema": {"type": "string"}}
_VOLUME = {
    "name": "volume_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": VOLUME_ID_PATTERN},
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(
    summary: str,
    *,
    body: str | None = None,
    reply: str | dict[str, Any] | None = None,
    params: list[Any] | None = None,
    code: str = "200",
) -> Any:
    """One operation: its success `code` (201, 202 and 204 have no body), and Fly's error body otherwise."""
    error = {"application/json": {"schema": _ref("ErrorResponse")}}
    schema = _ref(reply) if isinstance(reply, str) else reply or {"type": "object"}
    success: dict[str, Any] = {"description": "OK"}
    if code in ("200", "201"):
        success["content"] = {"application/json": {"schema": schema}}
    op: dict[str, Any] = {
        "summary": summary,
        "parameters": params or [],
        "responses": {code: success, "default": {"description": "error", "content": error}},
    }
    if body:
        # a bodyless POST counts as `{}`: the body is optional where `{}` is valid
        needed = any(f.required for f in msgspec.structs.fields(_BY_NAME[body]))
        op["requestBody"] = {"required": needed, "content": {"application/json": {"schema": _ref(body)}}}
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
    key = {
        "name": "key",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,128}$"},
    }
    org = {"name": "org_slug", "in": "query", "schema": {"type": "string"}}
    yes_no = {"type": "boolean"}
    one_state = "(" + "|".join(get_args(State)) + ")"
    list_params = [
        _APP,
        {"name": "include_deleted", "in": "query", "schema": yes_no},
        {"name": "region", "in": "query", "schema": {"type": "string"}},
        {"name": "state", "in": "query", "schema": {"type": "string", "pattern": f"^{one_state}(,{one_state})*$"}},
        {"name": "summary", "in": "query", "schema": yes_no},
    ]
    paths = {
        "/v1/apps": {
            "get": _op("List apps", reply="ListAppsResponse", params=[org]),
            "post": _op("Create an app", body="CreateAppRequest", reply="App", code="201"),
        },
        "/v1/apps/{app_name}": {
            "get": _op("Get an app", reply="App", params=[_APP]),
            "delete": _op("Destroy an app: its machines, then its releases and record", params=[_APP], code="202"),
        },
        one + "/metadata": {"get": _op("A machine's metadata", params=both, reply=_STRINGS)},
        one + "/metadata/{key}": {
            "post": _op("Set a metadata key", body="MetadataValue", params=[*both, key], code="204"),
            "delete": _op("Remove a metadata key", params=[*both, key], code="204"),
        },
        "/v1/platform/placements": {
            "post": _op("Dry-run placement", body="PlacementsRequest", reply="PlacementsResponse"),
        },
        m: {
            "get": _op("List machines", params=list_params, reply={"type": "array", "items": _ref("FlyMachine")}),
            "post": _op("Create a machine", body="CreateMachineRequest", reply="FlyMachine", params=[_APP]),
        },
        one: {
            "get": _op("Get a machine", reply="FlyMachine", params=both),
            "post": _op("Update a machine", body="UpdateMachineRequest", reply="FlyMachine", params=both),
            "delete": _op("Destroy a machine (?force=true or ?kill=true)", params=both),
        },
        one + "/cordon": {"post": _op("Cordon: edge proxies route nothing to it", params=both)},
        one + "/uncordon": {"post": _op("Uncordon", params=both)},
        one + "/start": {"post": _op("Start", params=both)},
        one + "/stop": {"post": _op("Stop", body="StopRequest", params=both)},
        one + "/restart": {"post": _op("Restart", params=both)},
        one + "/signal": {"post": _op("Signal", body="SignalRequest", params=both)},
        one + "/wait": {"get": _op("Wait for a state", params=wait_params)},
        one + "/events": {"get": _op("Events", params=both, reply={"type": "array", "items": _ref("FlyMachineEvent")})},
        **_volume_paths(),
        one + "/lease": {
            "get": _op("Get the lease", params=both),
            "post": _op("Acquire a lease", body="LeaseRequest", params=both),
            "delete": _op("Release a lease", params=[*both, _NONCE]),
        },
    }
    _link(paths, m, "post", one, "machine_id")
    _link(paths, "/v1/apps/{app_name}/volumes", "post", "/v1/apps/{app_name}/volumes/{volume_id}", "volume_id")
    return {
        "openapi": "3.1.0",
        "info": {"title": "fauxmad Machines API (Fly-compatible)", "version": "1"},
        "paths": paths,
        "components": {"schemas": components},
    }


def _operation_id(method: str, path: str) -> str:
    """`post /v1/apps/{app_name}/machines/{machine_id}/stop` -> `post_apps_app_name_machines_machine_id_stop`."""
    return method + "_" + path.removeprefix("/v1/").replace("{", "").replace("}", "").replace("/", "_")


def _link(paths: dict[str, Any], producer: str, method: str, prefix: str, param: str) -> None:
    """Name every operation, and link what `method producer` makes (its body's `id`) to every operation on
    `prefix...`: what a client does next with the machine or volume it made (OpenAPI links; schemathesis
    follows them in its stateful test)."""
    for path, operations in paths.items():
        for verb, operation in operations.items():
            operation.setdefault("operationId", _operation_id(verb, path))
    created = paths[producer][method]["responses"]["200"]
    created["links"] = {
        operation["operationId"]: {
            "operationId": operation["operationId"],
            "parameters": {"app_name": "$request.path.app_name", param: "$response.body#/id"},
        }
        for path, operations in paths.items()
        if path.startswith(prefix)
        for operation in operations.values()
    }


def _volume_paths() -> dict[str, Any]:
    v = "/v1/apps/{app_name}/volumes"
    one = v + "/{volume_id}"
    both = [_APP, _VOLUME]
    snapshots = {"type": "array", "items": _ref("VolumeSnapshot")}
    return {
        v: {
            "get": _op("List volumes", params=[_APP], reply={"type": "array", "items": _ref("Volume")}),
            "post": _op(
                "Create a volume (snapshot_id: restore it)", body="CreateVolumeRequest", reply="Volume", params=[_APP]
            ),
        },
        one: {
            "get": _op("Get a volume", params=both, reply="Volume"),
            "delete": _op("Destroy a volume", params=both, reply="Volume"),
        },
        one + "/extend": {
            "put": _op("Extend a volume", body="ExtendVolumeRequest", reply="ExtendVolumeResponse", params=both)
        },
        one + "/snapshots": {
            "get": _op("List a volume's snapshots", params=both, reply=snapshots),
            "post": _op("Snapshot a volume (fauxmad answers with the snapshot)", params=both, reply="VolumeSnapshot"),
        },
    }


DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>fauxmad Machines API</title></head>
<body><h1>fauxmad Machines API</h1>
<p>Fly's Machines API paths under <code>/v1</code>, answered by fauxmad's brokers over NATS.
The machine-readable document is <a href="/openapi.json">/openapi.json</a>; what fauxmad adds
(extensions) and what it leaves out: <code>docs/reference/http-api.md</code> and
<code>docs/fly-api-conformance.md</code> in fauxmad's repository.</p></body></html>
"""
