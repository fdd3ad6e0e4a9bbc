"""The API's Prometheus metrics (`--metrics-listen`): requests by route, method and status, and their latency."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Histogram

REQUESTS = Counter("fauxmad_api_requests_total", "HTTP requests answered", ["route", "method", "status"])
LATENCY = Histogram(
    "fauxmad_api_request_seconds",
    "HTTP request latency",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
)


def _route(request: web.Request) -> str:
    """The route's template (`/v1/apps/{app_name}/machines`), never the raw path: labels stay few."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def measure(request: web.Request, handler: Any) -> web.StreamResponse:
    started = time.perf_counter()
    response: web.StreamResponse = await handler(request)
    route = _route(request)
    REQUESTS.labels(route, request.method, str(response.status)).inc()
    LATENCY.labels(route).observe(time.perf_counter() - started)
    return response
