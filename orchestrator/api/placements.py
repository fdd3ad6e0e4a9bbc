"""`POST /v1/platform/placements`: a dry run, nothing reserved. Per region, how many of `count` machines the
workers' free room holds (their last heartbeats), and beyond Fly the brokers' ranking of one more
(`placements.simulate`: every worker's subscores and rejections)."""

from __future__ import annotations

import builtins
from typing import Any

from aiohttp import web

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.fleet import RegionSummary, SimulateRequest, WorkerInfo, WorkersListRequest
from bus.contract.machines import Guest
from orchestrator.api import types
from orchestrator.api.http import BROKERS, body, json


def _room(workers: list[WorkerInfo], guest: types.FlyGuest) -> int:
    room = 0
    for worker in workers:
        if worker.cordoned:
            continue
        cpus = worker.capacity.cpus - worker.used.cpus
        memory = worker.capacity.memory_mb - worker.used.memory_mb
        room += max(0, min(cpus // guest.cpus, memory // guest.memory_mb))
    return room


async def placements(req_: web.Request) -> web.Response:
    req = await body(req_, types.PlacementsRequest)
    brokers = req_.app[BROKERS]
    if req.region is None:
        known = await brokers.call(subjects.API_REGIONS_LIST, b"", builtins.list[RegionSummary], timeout=10)
        regions = [r.region for r in known]
    else:
        regions = req.region.split(",")
    out = []
    guest = Guest(cpus=req.compute.cpus, memory_mb=req.compute.memory_mb, cpu_kind=req.compute.cpu_kind)
    for region in regions:
        workers = await brokers.call(
            subjects.API_WORKERS_LIST, WorkersListRequest(region=region), list[WorkerInfo], timeout=10
        )
        simulate = SimulateRequest(app=req.app, region=region, guest=guest)
        answer = await brokers.raw(subjects.API_PLACEMENTS_SIMULATE, simulate, timeout=10)
        explain: dict[str, Any] = decode(dict[str, Any], answer)  # type: ignore[arg-type]
        count = min(req.count, _room(workers, req.compute))
        out.append(types.RegionPlacement(region=region, count=count, explain=explain))
    return json(types.PlacementsResponse(regions=out))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/platform/placements", placements)
