"""A machine's metadata (`config.metadata`): read from `get`, written by an `update` that changes only the
labels, which the worker applies in place (the same instance, no restart).

A machine's cordon (Fly's `cordon`/`uncordon`: the proxy routes nothing to it) is one such label,
`bus.contract.machines.CORDONED_LABEL`: the routing index carries a machine's labels, so every edge proxy sees it
from its KV watch, and nothing else in the fleet needs to know of it."""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from bus.contract.machines import CORDONED_LABEL, GetRequest, UpdateRequest
from orchestrator.api import types
from orchestrator.api.http import ClientError, ask, body, json, machine_id, nonce

_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def _key(request: web.Request) -> str:
    key = request.match_info["key"]
    if not _KEY.match(key):
        raise ClientError(400, f"invalid metadata key {key!r}: letters, digits, '_', '.', '-' (at most 128)")
    return key


async def get_metadata(request: web.Request) -> web.Response:
    got = await ask(request, "get", GetRequest(id=machine_id(request), events=False))
    return json(types.visible_metadata(got.config.metadata))


async def _relabel(request: web.Request, key: str, value: str | None) -> web.Response:
    mid = machine_id(request)
    got = await ask(request, "get", GetRequest(id=mid, events=False))
    labels = dict(got.config.metadata)
    if value is None:
        labels.pop(key, None)
    else:
        labels[key] = value
    config = msgspec.structs.replace(got.config, metadata=labels)
    await ask(request, "update", UpdateRequest(id=mid, config=config, lease_nonce=nonce(request)))
    return web.Response(status=204)


async def set_metadata(request: web.Request) -> web.Response:
    machine_id(request)
    key = _key(request)
    req = await body(request, types.MetadataValue)
    return await _relabel(request, key, req.value)


async def delete_metadata(request: web.Request) -> web.Response:
    return await _relabel(request, _key(request), None)


async def cordon(request: web.Request) -> web.Response:
    await _relabel(request, CORDONED_LABEL, "true")
    return json({"ok": True})


async def uncordon(request: web.Request) -> web.Response:
    await _relabel(request, CORDONED_LABEL, None)
    return json({"ok": True})


def add_routes(app: web.Application, one: str) -> None:
    app.router.add_get(one + "/metadata", get_metadata)
    app.router.add_post(one + "/metadata/{key}", set_metadata)
    app.router.add_delete(one + "/metadata/{key}", delete_metadata)
    app.router.add_post(one + "/cordon", cordon)
    app.router.add_post(one + "/uncordon", uncordon)
