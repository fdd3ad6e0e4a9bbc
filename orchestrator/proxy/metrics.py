"""The proxy's Prometheus metrics, and the admin listener that serves them at `/metrics`.

A registry of its own per proxy (not prometheus_client's global one), so two proxies in one process (the
tests) count apart. The admin listener is a few lines of asyncio rather than prometheus_client's
threaded server: the proxy is one event loop and stays one.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fauxmad_proxy_requests",
            "requests answered, by app, the region of the machine that served it ('' for none) and status",
            ["app", "region", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "fauxmad_proxy_request_seconds",
            "time from the request head to the end of the response, by app",
            ["app"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.woken = Counter(
            "fauxmad_proxy_machines_woken",
            "machines started, resumed or created for requests, by app and kind (start, resume, create)",
            ["app", "kind"],
            registry=self.registry,
        )
        self.stopped = Counter(
            "fauxmad_proxy_machines_stopped", "idle machines stopped, by app", ["app"], registry=self.registry
        )
        self.refused = Counter(
            "fauxmad_proxy_upstream_failures",
            "connections to machines that were refused or failed, by app",
            ["app"],
            registry=self.registry,
        )
        # by code only: an unknown app's name is the client's to choose, and a label of it would let any client
        # grow the registry without bound
        self.refusals = Counter(
            "fauxmad_proxy_refusals",
            "responses the proxy wrote itself instead of a machine's, by status code (also those naming no app)",
            ["code"],
            registry=self.registry,
        )

        # each label set's counter and histogram, looked up once: `labels()` costs more than the count itself
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def observe(self, app: str, region: str, status: int, seconds: float) -> None:
        key = (app, region, status)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(app, region, str(status)),
                self.latency.labels(app),
            )
        children[0].inc()
        children[1].observe(seconds)

    def refusal(self, status: int) -> None:
        self.refusals.labels(str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve_admin(metrics: ProxyMetrics, host: str, port: int) -> asyncio.Server:
    """GET /metrics (Prometheus text) and GET /healthz; anything else 404. One request per connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            if path == b"/metrics":
                body, kind = metrics.render(), CONTENT_TYPE_LATEST
                status = "200 OK"
            elif path == b"/healthz":
                body, kind, status = b"ok\n", "text/plain", "200 OK"
            else:
                body, kind, status = b"not found\n", "text/plain", "404 Not Found"
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n"
                "connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    return await asyncio.start_server(handle, host, port, limit=8 * 1024)
