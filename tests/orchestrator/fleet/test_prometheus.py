"""Metrics as an operator sees them: a real Prometheus (Debian's `prometheus`) scrapes a dev fleet.

A dev fleet's workers and broker (`FleetSpec(metrics=True)`), an API and an edge proxy each serve /metrics on a
free port; Prometheus runs with the shipped scrape config (deploy/prometheus/prometheus.yml: its jobs and settings,
the targets and a 1 s interval swapped in), its own storage and listener. After creates, proxied requests and API
calls, Prometheus's own HTTP API (/api/v1/targets, /api/v1/metadata, /api/v1/query) must show every target up,
every series docs/reference/metrics.md lists, with sane values, and data for the Grafana dashboard's queries
(deploy/grafana/fauxmad.json) that the traffic exercised. The pure tests keep the dashboard to the documented
series and the scrape config to the ports the systemd units give.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML comes with schemathesis (the dev extra)

from bus.contract.errors import NoCapacity, Unreachable
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Check, Guest, MachineConfig, RestartPolicy
from bus.local.ports import free_port
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT, arun, until, wait_until
from tests.orchestrator import proxy_kit as kit
from tests.orchestrator.api.test_api import start_api

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fauxmad.json"
METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"
REGION = "prm"
# documented series the traffic here does not make: a connection a machine refused or dropped (a labelled
# counter has no series until its first count)
NOT_EXERCISED = {"fauxmad_proxy_upstream_failures_total"}
WINDOW = "5m"  # the dashboard's $__rate_interval here: longer than the test, so no rate falls back to 0 meanwhile


def documented() -> set[str]:
    """The series docs/reference/metrics.md lists: each table row's first cell."""
    return set(re.findall(r"^\| `(fauxmad_\w+)` \|", METRICS_PAGE.read_text(), re.M))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def families(expr: str) -> set[str]:
    """The documented names a query reads: a histogram's _bucket, _sum and _count are its family's."""
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"\bfauxmad_\w+", expr)}


def test_the_dashboard_reads_only_documented_series_and_shows_each() -> None:
    listed = documented()
    assert len(listed) >= 20, listed
    shown: set[str] = set()
    for title, expr in dashboard_queries():
        unknown = families(expr) - listed
        assert not unknown, f"dashboard panel {title!r} reads {sorted(unknown)}, not in docs/reference/metrics.md"
        assert "fauxmad_" in expr, f"dashboard panel {title!r} reads no fauxmad series: {expr}"
        shown |= families(expr)
    assert not listed - shown, f"documented series no dashboard panel shows: {sorted(listed - shown)}"


@pytest.mark.fleet  # starts processes of its own
def test_the_scrape_config_names_the_ports_the_units_give() -> None:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    ports = {
        job["job_name"]: {t.rsplit(":", 1)[1] for s in job["static_configs"] for t in s["targets"]}
        for job in config["scrape_configs"]
    }
    assert set(ports) == {"fauxmad-worker", "fauxmad-broker", "fauxmad-api", "fauxmad-proxy"}
    for kind in ("worker", "broker"):
        unit = (ROOT / "deploy" / "systemd" / f"fauxmad-{kind}.service").read_text()
        (listen,) = re.findall(r"^ExecStart=.* --metrics-listen \S+:(\d+)", unit, re.M)
        assert ports[f"fauxmad-{kind}"] == {listen}, (kind, ports, listen)
    page = METRICS_PAGE.read_text()  # the processes without a unit: the ports the docs tell them
    assert f"--metrics-listen 0.0.0.0:{ports['fauxmad-api'].pop()}" in page
    assert f"--admin 0.0.0.0:{ports['fauxmad-proxy'].pop()}" in page
    if PROMTOOL.exists():
        done = subprocess.run([str(PROMTOOL), "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------------
# a real Prometheus


@dataclass
class Prom:
    base: str

    def get(self, path: str, **params: str) -> Any:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        return [(r["metric"], float(r["value"][1])) for r in self.get("/api/v1/query", query=expr)["result"]]

    def scraped_since(self, moment: float) -> bool:
        """Whether every target's last scrape began after `moment` (seconds since the epoch)."""
        active = self.get("/api/v1/targets", state="active")["activeTargets"]
        starts = [datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", t["lastScrape"])) for t in active]
        return bool(starts) and min(s.timestamp() for s in starts) > moment

    def value(self, expr: str) -> float:
        """The one value of a query that sums to one series (0 when there is none yet)."""
        result = self.query(f"sum({expr})")
        return result[0][1] if result else 0.0


@dataclass
class Stack:
    fleet: DevFleet
    api: str
    proxy: kit.ProxyProcess
    prom: Prom
    targets: dict[str, list[str]]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not PROMETHEUS.exists():
        pytest.skip("no /usr/bin/prometheus (Debian's prometheus package; .ci/run installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    spec = FleetSpec(regions=[REGION], workers_per_region=2, cpus=8, memory_mb=4096, brokers=1, metrics=True)
    with DevFleet(spec) as fleet:
        api_port = free_port()
        api_proc, api = start_api(fleet.url, ["--metrics-listen", f"127.0.0.1:{api_port}"])
        proxy = kit.ProxyProcess(fleet.url, REGION, tmp)
        prom_proc = None
        try:
            targets = {
                "fauxmad-worker": [f"127.0.0.1:{p}" for n, p in fleet.metrics.items() if n.startswith("worker-")],
                "fauxmad-broker": [f"127.0.0.1:{p}" for n, p in fleet.metrics.items() if n.startswith("broker-")],
                "fauxmad-api": [f"127.0.0.1:{api_port}"],
                "fauxmad-proxy": [f"127.0.0.1:{proxy.admin}"],
            }
            config = yaml.safe_load(SCRAPE_CONFIG.read_text())  # the shipped jobs, with this fleet's targets
            config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
            for job in config["scrape_configs"]:
                job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            config_path = tmp / "prometheus.yml"
            config_path.write_text(yaml.safe_dump(config))
            if PROMTOOL.exists():
                checked = subprocess.run([str(PROMTOOL), "check", "config", str(config_path)], capture_output=True)
                assert checked.returncode == 0, checked.stdout + checked.stderr
            port = free_port()
            log = (tmp / "prometheus.log").open("wb")
            prom_proc = subprocess.Popen(
                [
                    str(PROMETHEUS),
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
            base = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                assert prom_proc is not None and prom_proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
                try:
                    with urllib.request.urlopen(base + "/-/ready", timeout=2) as response:
                        return bool(response.status == 200)
                except OSError:
                    return False

            wait_until(ready, "Prometheus ready", timeout=60)
            yield Stack(fleet, api, proxy, Prom(base), targets)
        finally:
            if prom_proc is not None:
                prom_proc.terminate()
                prom_proc.wait(20)
            proxy.stop()
            api_proc.terminate()
            api_proc.wait(10)


def api_call(base: str, path: str) -> int:
    try:
        with urllib.request.urlopen(base + path, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def traffic(stack: Stack, app: str) -> None:
    """Creates (one placed with a passing check, one too big, one that exits and is restarted once), a stop and
    a destroy; a request through the proxy to the app's stopped machine (woken, then stopped when idle), one to an
    app that does not exist (refused); API calls."""
    client = await FleetClient.connect(stack.fleet.url)
    try:
        check = Check(type="cmd", command=["true"], interval="100ms", timeout="1s")
        config = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=64), checks={"ok": check})
        deadline = time.monotonic() + 30
        while True:  # the broker learns the workers from their heartbeats
            try:
                machine = await client.create(app, CreateRequest(region=REGION, config=config))
                break
            except (NoCapacity, Unreachable):
                assert time.monotonic() < deadline, "no create placed"
                await asyncio.sleep(0.1)
        with pytest.raises(NoCapacity):
            await client.create(
                app, CreateRequest(region=REGION, config=MachineConfig(cmd=["true"], guest=Guest(cpus=64)))
            )
        failing = MachineConfig(
            cmd=["sh", "-c", "exit 3"], guest=Guest(cpus=1, memory_mb=64), restart=RestartPolicy(max_retries=1)
        )
        await client.create(app, CreateRequest(region=REGION, config=failing))
        await client.stop(app, machine.id)
        await client.destroy(app, machine.id)
    finally:
        await client.close()
    spec = kit.spec_for(f"{app}web", {REGION: 1}, 'auto_stop = "stop"\nidle_timeout = "1s"')
    release = await kit.publish(stack.fleet.url, spec)
    await kit.machines(stack.fleet.url, spec, release, [(REGION, False)])

    async def served() -> bool:  # once the proxy's replica of the machines index has the machine
        return (await kit.get(stack.proxy.port, f"{spec.app}.localhost")).status == 200

    await until(served, "a request through the proxy served", timeout=30, interval=0.2)
    assert (await kit.get(stack.proxy.port, f"{app}-none.localhost")).status == 404  # a refusal the proxy counts
    assert api_call(stack.api, f"/v1/apps/{app}/machines") == 200
    assert api_call(stack.api, f"/v1/apps/{app}/machines/0123456789abcd") == 404


def exposed(name: str) -> str:
    """A counter's samples end in _total, a histogram's count in _count; a gauge is its name."""
    return name if name.endswith("_total") or name == "fauxmad_worker_machines" else f"{name}_count"


@pytest.mark.timeout(300)
def test_prometheus_scrapes_every_target_and_the_documented_series(stack: Stack, unique: Any) -> None:
    prom = stack.prom
    app = unique("prom")
    arun(traffic(stack, app))

    def all_up() -> list[dict[str, Any]]:
        active = prom.get("/api/v1/targets", state="active")["activeTargets"]
        up = [t for t in active if t["health"] == "up"]
        return up if len(up) == sum(len(t) for t in stack.targets.values()) else []

    up = wait_until(all_up, "every target up in /api/v1/targets", timeout=60, interval=0.5)
    assert {t["labels"]["job"] for t in up} == set(stack.targets)
    assert {t["scrapeUrl"].split("/")[2] for t in up} == {a for addrs in stack.targets.values() for a in addrs}
    assert {labels["job"]: v for labels, v in prom.query("min by (job) (up)")} == dict.fromkeys(stack.targets, 1.0)

    # every documented family known to Prometheus from the scrapes (a labelled one without series too); the
    # OpenMetrics exposition names a counter without its _total, the text one with it
    metadata = prom.get("/api/v1/metadata")
    missing = [n for n in documented() if n not in metadata and n.removesuffix("_total") not in metadata]
    assert not missing, f"documented but never exposed: {sorted(missing)}"
    for name in documented() - NOT_EXERCISED:
        kind = (metadata.get(name) or metadata[name.removesuffix("_total")])[0]["type"]
        assert kind == ("counter" if name.endswith("_total") else "gauge" if exposed(name) == name else "histogram")

    counted = {  # what the traffic made: more than nothing
        'fauxmad_worker_requests_total{verb="reserve",outcome="ok"}',
        "fauxmad_worker_request_seconds_count",
        "fauxmad_worker_commits_total",
        "fauxmad_worker_commit_batch_size_count",
        "fauxmad_worker_commit_seconds_count",
        "fauxmad_worker_machines",
        'fauxmad_worker_check_results_total{status="passing"}',
        "fauxmad_worker_restarts_total",
        'fauxmad_broker_creates_total{strategy="scatter",outcome="placed"}',
        'fauxmad_broker_creates_total{strategy="scatter",outcome="503"}',
        'fauxmad_broker_create_seconds_count{strategy="scatter"}',
        "fauxmad_broker_gather_asked_count",
        "fauxmad_broker_gather_answered_count",
        "fauxmad_broker_scatter_shared_count",
        'fauxmad_api_requests_total{route="/v1/apps/{app_name}/machines",method="GET",status="200"}',
        'fauxmad_api_requests_total{method="GET",status="404"}',
        "fauxmad_api_request_seconds_count",
        'fauxmad_proxy_requests_total{status="200",region="prm"}',
        "fauxmad_proxy_request_seconds_count",
        'fauxmad_proxy_machines_woken_total{kind="start"}',
        "fauxmad_proxy_machines_stopped_total",  # the woken machine, idle for 1 s
        'fauxmad_proxy_refusals_total{code="404"}',  # an unknown app
    }
    assert {exposed(n) for n in documented() - NOT_EXERCISED} <= {re.sub(r"\{.*", "", s) for s in counted}

    def all_counted() -> list[str]:
        return [s for s in counted if prom.value(s) <= 0]

    wait_until(lambda: not all_counted(), "every exercised series above 0", timeout=60, interval=0.5)
    assert not all_counted()

    # sane values: a histogram's +Inf bucket is its count; sums are non-negative (a size at least 1 per
    # observation); gauges whole numbers in range; a commit holds at least one record
    histograms = ["fauxmad_worker_request_seconds", "fauxmad_worker_commit_seconds", "fauxmad_broker_create_seconds"]
    histograms += ["fauxmad_broker_gather_asked", "fauxmad_api_request_seconds", "fauxmad_proxy_request_seconds"]
    for name in histograms:
        count = prom.value(f"{name}_count")
        assert prom.value(f'{name}_bucket{{le="+Inf"}}') == count > 0, name
        assert prom.value(f"{name}_sum") >= 0, name
    assert prom.value("fauxmad_worker_commit_batch_size_sum") >= prom.value("fauxmad_worker_commit_batch_size_count")
    assert prom.value("fauxmad_broker_gather_answered_sum") <= prom.value("fauxmad_broker_gather_asked_sum")
    assert prom.value("fauxmad_broker_gather_asked_sum") >= prom.value("fauxmad_broker_gather_asked_count")
    for labels, count in prom.query("fauxmad_worker_machines"):
        assert count >= 0 and count == int(count) and count < 100, (labels, count)
    routes = {labels["route"] for labels, _ in prom.query("fauxmad_api_requests_total")}
    assert "/v1/apps/{app_name}/machines/{machine_id}" in routes and not [r for r in routes if app in r], routes


@pytest.mark.timeout(300)
def test_the_dashboard_queries_get_data_from_the_fleet(stack: Stack, unique: Any) -> None:
    """Every dashboard query but the unexercised ones answers with a number once traffic came after a first scrape
    (a rate needs two samples of a series that moved; a quantile or a mean of rates that are 0 is NaN)."""
    prom, app = stack.prom, unique("dash")
    for _ in range(2):  # the same app twice, each round scraped: its series (by app, by route) move between scrapes
        arun(traffic(stack, app))
        done = time.time()
        wait_until(partial(prom.scraped_since, done), "every target scraped after the traffic", timeout=60)
    expected = [(t, e) for t, e in dashboard_queries() if not families(e) & NOT_EXERCISED]
    assert len(expected) >= 15

    def empty() -> list[str]:
        out = []
        for title, expr in expected:
            values = [v for _, v in prom.query(expr.replace("$__rate_interval", WINDOW))]
            if not [v for v in values if math.isfinite(v)]:
                out.append(f"{title}: {expr}")
        return out

    deadline = time.monotonic() + 60
    while (left := empty()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"dashboard queries without data: {left}"
    for title, expr in dashboard_queries():
        if families(expr) & NOT_EXERCISED:  # Prometheus accepts the query; whether it has data depends on the host
            # (a proxied wake on a loaded one may fail upstream once before the machine answers)
            values = [v for _, v in prom.query(expr.replace("$__rate_interval", WINDOW))]
            assert all(v >= 0 or math.isnan(v) for v in values), (title, values)
