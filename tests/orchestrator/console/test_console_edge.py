"""The console's edge numbers are read from what a proxy's metrics really expose (a pure parse)."""

from __future__ import annotations

from prometheus_client import generate_latest

from orchestrator.console.data import edge_numbers
from orchestrator.proxy.metrics import ProxyMetrics


def test_an_apps_requests_autostarts_and_resumes_from_a_proxys_metrics() -> None:
    metrics = ProxyMetrics()
    for status in (200, 200, 200, 502):
        metrics.observe("web", "mad", status, 0.01)
    metrics.observe("other", "mad", 200, 0.01)
    metrics.woken.labels("web", "start").inc()
    metrics.woken.labels("web", "create").inc()
    metrics.woken.labels("web", "resume").inc(3)
    got = edge_numbers(generate_latest(metrics.registry).decode(), "web")
    assert (got.requests, got.errors, got.autostarts, got.resumes) == (4, 1, 2, 3)
    assert edge_numbers(generate_latest(metrics.registry).decode(), "nobody").requests == 0
