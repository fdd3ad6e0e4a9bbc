"""Fly's volume paths (`/v1/apps/{app}/volumes...`), each one request on the brokers' volume subjects.

A volume's id in a path that is not one (`vol_` and 16 characters) is a 404, as a machine id is.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from aiohttp import web

from bus.contract import subjects
from bus.contract.base import VOLUME_ID_PATTERN
from bus.contract.deadlines import volume_wait
from bus.contract.volumes import (
    Volume,
    VolumeApiCreateRequest,
    VolumeApiListRequest,
    VolumeExtendRequest,
    VolumeIdRequest,
    VolumeSnapshot,
)
from orchestrator.api import types
from orchestrator.api.http import BROKERS, ClientError, app_name, body, json

T = TypeVar("T")
_VOLUME_ID = re.compile(VOLUME_ID_PATTERN)


def volume_id(request: web.Request) -> str:
    value = request.match_info["volume_id"]
    if not _VOLUME_ID.match(value):
        raise ClientError(404, f"volume {value!r} not found")
    return value


async def _ask(request: web.Request, verb: str, payload: Any, kind: type[T]) -> T:
    subject = subjects.api_volumes(app_name(request), verb)
    return await request.app[BROKERS].call(subject, payload, kind, timeout=volume_wait(verb))


async def list_volumes(request: web.Request) -> web.Response:
    return json(await _ask(request, "list", VolumeApiListRequest(), list[Volume]))


async def create_volume(request: web.Request) -> web.Response:
    app_name(request)
    req = await body(request, types.CreateVolumeRequest)
    create = VolumeApiCreateRequest(region=req.region, name=req.name, size_gb=req.size_gb, snapshot_id=req.snapshot_id)
    return json(await _ask(request, "create", create, Volume))


async def get_volume(request: web.Request) -> web.Response:
    return json(await _ask(request, "get", VolumeIdRequest(id=volume_id(request)), Volume))


async def extend_volume(request: web.Request) -> web.Response:
    vid = volume_id(request)
    req = await body(request, types.ExtendVolumeRequest)
    volume = await _ask(request, "extend", VolumeExtendRequest(id=vid, size_gb=req.size_gb), Volume)
    # the worker grows it online where the kernel lets it; else it grows when its machine starts again
    grown = volume.size_limit != "loop" or volume.blocks * volume.block_size >= volume.size_gb * 0.9 * (1 << 30)
    return json(types.ExtendVolumeResponse(needs_restart=not grown, volume=volume))


async def destroy_volume(request: web.Request) -> web.Response:
    return json(await _ask(request, "destroy", VolumeIdRequest(id=volume_id(request)), Volume))


async def list_snapshots(request: web.Request) -> web.Response:
    found = await _ask(request, "snapshots", VolumeIdRequest(id=volume_id(request)), list[VolumeSnapshot])
    return json(found)


async def create_snapshot(request: web.Request) -> web.Response:
    snap = await _ask(request, "snapshot", VolumeIdRequest(id=volume_id(request)), VolumeSnapshot)
    return json(snap)


def add_routes(app: web.Application) -> None:
    v = "/v1/apps/{app_name}/volumes"
    one = v + "/{volume_id}"
    app.router.add_get(v, list_volumes)
    app.router.add_post(v, create_volume)
    app.router.add_get(one, get_volume)
    app.router.add_delete(one, destroy_volume)
    app.router.add_put(one + "/extend", extend_volume)
    app.router.add_get(one + "/snapshots", list_snapshots)
    app.router.add_post(one + "/snapshots", create_snapshot)
