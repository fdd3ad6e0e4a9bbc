"""The proxy's Prometheus metrics, and the admin listener that serves them at `/metrics`.

A registry of its own per proxy (not prometheus_client's global one), so two proxies in one process (the
tests) count apart. The admin listener is a few lines of asyncio rather than prometheus_client's
threaded server: the proxy is one event loop and stays one.

The two families every request touches (its count and its latency) are kept in plain dicts and read out when
the registry is collected (`Served`), not in prometheus_client's children: their `inc` and `observe` take a
lock each, a twentieth of a proxied GET's CPU, which one event loop never needs. They are exposed the same
(names, labels, buckets), without the `_created` series.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Served(Collector):
    """`fauxmad_proxy_requests_total{app,region,status}` and `fauxmad_proxy_request_seconds{app}`, counted in
    dicts by the one event loop and turned into families at scrape time."""

    REQUESTS = (
        "fauxmad_proxy_requests",
        "requests answered, by app, the region of the machine that served it ('' for none) and status",
    )
    LATENCY = ("fauxmad_proxy_request_seconds", "time from the request head to the end of the response, by app")

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self.counts: dict[tuple[str, str, int], int] = {}
        self.latency: dict[str, list[float]] = {}  # app -> a count per bucket (+Inf last), then the sum

    def observe(self, app: str, region: str, status: int, seconds: float) -> None:
        key = (app, region, status)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        histogram = self.latency.get(app)
        if histogram is None:
            histogram = self.latency[app] = [0.0] * (len(self.buckets) + 2)
        histogram[bisect.bisect_left(self.buckets, seconds)] += 1  # the first bucket whose bound is >= seconds
        histogram[-1] += seconds

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(*self.REQUESTS, labels=("app", "region", "status"))
        yield HistogramMetricFamily(*self.LATENCY, labels=("app",))

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(*self.REQUESTS, labels=("app", "region", "status"))
        for (app, region, status), count in self.counts.items():
            requests.add_metric((app, region, str(status)), count)
        yield requests
        latency = HistogramMetricFamily(*self.LATENCY, labels=("app",))
        bounds = [_le(bound) for bound in (*self.buckets, math.inf)]
        for app, histogram in self.latency.items():
            below = 0.0
            cumulative: list[tuple[str, float]] = []
            for bound, in_bucket in zip(bounds, histogram, strict=False):  # the sum, last, is not a bucket
                below += in_bucket
                cumulative.append((bound, below))
            latency.add_metric((app,), cumulative, histogram[-1])
        yield latency


def _le(bound: float) -> str:
    """A bucket's `le` label, written as prometheus_client writes it (`0.0005`, `1.0`, `+Inf`)."""
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.served = Served()
        self.registry.register(self.served)
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

    def observe(self, app: str, region: str, status: int, seconds: float) -> None:
        self.served.observe(app, region, status, seconds)

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
