"""`/v1/apps`: fauxmad keeps no app records (an app is the name its machines share), so apps are read off the
workers' heartbeats (machines per app), created by name only, and destroyed by destroying their machines.
"""

from __future__ import annotations

import builtins

from aiohttp import web

from bus.contract import subjects
from bus.contract.fleet import WorkerInfo, WorkersListRequest
from bus.contract.machines import DestroyRequest, ListRequest, Machine
from orchestrator.api import types
from orchestrator.api.http import BROKERS, app_name, body, json


async def _counts(request: web.Request) -> dict[str, int]:
    workers = await request.app[BROKERS].call(
        subjects.API_WORKERS_LIST, WorkersListRequest(), builtins.list[WorkerInfo], timeout=10
    )
    counts: dict[str, int] = {}
    for worker in workers:
        for name, n in worker.app_machines.items():
            counts[name] = counts.get(name, 0) + n
    return counts


def _app(name: str, count: int) -> types.App:
    return types.App(id=name, name=name, status="deployed" if count else "pending", machine_count=count)


async def list_apps(request: web.Request) -> web.Response:
    counts = await _counts(request)
    apps = [_app(name, n) for name, n in sorted(counts.items()) if n]
    return json(types.ListAppsResponse(total_apps=len(apps), apps=apps))


async def create_app(request: web.Request) -> web.Response:
    req = await body(request, types.CreateAppRequest)
    return json(_app(req.app_name, 0), status=201)


async def get_app(request: web.Request) -> web.Response:
    name = app_name(request)
    return json(_app(name, (await _counts(request)).get(name, 0)))


async def delete_app(request: web.Request) -> web.Response:
    name = app_name(request)
    brokers = request.app[BROKERS]
    found = await brokers.call(subjects.api_machines(name, "list"), ListRequest(), builtins.list[Machine], timeout=10)
    for machine in found:
        destroy = DestroyRequest(id=machine.id, force=True)
        await brokers.call(subjects.api_machines(name, "destroy"), destroy, Machine, timeout=25)
    return web.Response(status=202)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/apps", list_apps)
    app.router.add_post("/v1/apps", create_app)
    app.router.add_get("/v1/apps/{app_name}", get_app)
    app.router.add_delete("/v1/apps/{app_name}", delete_app)
