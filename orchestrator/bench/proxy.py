"""`fauxmad bench proxy`: what the edge costs and how fast it wakes machines, on a real fleet and proxy.

One dev fleet (one worker), one app with an `[http_service]`, one machine running examples/echo/app.py,
one `fauxmad proxy` process. Measured in one run: the same GET sent directly to the machine and through
the proxy (keep-alive, one at a time, alternating, so both see the same machine and the same noise);
requests per second through the proxy with `concurrency` keep-alive clients; and the first byte of a
request that finds the machine suspended (the proxy resumes it) or stopped (the proxy starts it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from bus.connection import connect
from bus.jetstream import ensure_fleet_resources
from bus.messages import CreateRequest
from orchestrator.bench import BenchError
from orchestrator.bench.http_client import Client
from orchestrator.bench.report import LATENCY_ALIGN, LATENCY_COLUMNS, Report, Table
from orchestrator.bench.stats import Latency, summarize
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.proxy.upstream import connect_when_up
from orchestrator.reconcile.over_nats import KVReleaseStore
from orchestrator.reconcile.releases import Releases
from orchestrator.reconcile.spec import PRIMARY, parse_spec

ECHO = Path(__file__).resolve().parents[2] / "examples" / "echo" / "app.py"
APP = "benchedge"
REGION = "edge"


class ProxyOptions(msgspec.Struct, frozen=True, kw_only=True):
    requests: int = 2000
    concurrency: int = 32
    seconds: float = 3.0
    wakes: int = 10


class ProxyResult(msgspec.Struct, kw_only=True):
    options: ProxyOptions
    direct: Latency
    proxied: Latency
    overhead_p50_ms: float
    overhead_p99_ms: float
    requests_per_second: float
    errors: int
    after_resume: Latency
    after_start: Latency


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_proxy(url: str, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    argv = [sys.executable, "-m", "orchestrator.cli", "proxy", "--listen", f"127.0.0.1:{port}", "--region", REGION]
    with log.open("ab") as out:
        proc = subprocess.Popen([*argv, "--nats", url], stdout=out, stderr=out, env=dict(os.environ))
    deadline = time.monotonic() + 20
    while b"listening on" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise BenchError(f"the proxy did not start: {log.read_text()[-500:]}")
        time.sleep(0.05)
    return proc, port


async def _machine(url: str) -> tuple[str, int]:
    """Publish the app (as a deploy would) and start its one machine; (id, port) once it listens."""
    spec = parse_spec(
        f'app = "{APP}"\ncmd = ["python3", "{ECHO}"]\n[guest]\nmemory_mb = 64\n[regions]\n{REGION} = 1\n'
        "[http_service]\nauto_start = true\n[http_service.concurrency]\nsoft_limit = 1000\nhard_limit = 1000\n"
    )
    nc = await connect(url, "fauxmad-bench-proxy")
    try:
        releases = Releases(KVReleaseStore((await ensure_fleet_resources(nc.jetstream())).apps))
        release = await releases.create(spec, "bench proxy")
        await releases.point(APP, release.version)
    finally:
        await nc.close()
    client = await FleetClient.connect(url)
    try:
        config = spec.machine_config(release.version, PRIMARY)
        machine = await client.create(APP, CreateRequest(region=REGION, config=config))
    finally:
        await client.close()
    assert machine.port is not None
    conn = await connect_when_up(("127.0.0.1", machine.port), 10.0)
    if conn is None:
        raise BenchError(f"the echo machine never listened on {machine.port}")
    conn.close()
    return machine.id, machine.port


async def _alternating(proxy_port: int, machine_port: int, n: int) -> tuple[list[float], list[float], int]:
    direct, proxied, errors = Client(machine_port), Client(proxy_port), 0
    host = f"{APP}.localhost"
    direct_times: list[float] = []
    proxied_times: list[float] = []
    try:
        for _ in range(50):  # warm both paths (connections, the proxy's route table)
            await direct.request(host)
            await proxied.request(host)
        for _ in range(n):
            started = time.perf_counter()
            errors += (await direct.request(host)).status != 200
            direct_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            errors += (await proxied.request(host)).status != 200
            proxied_times.append(time.perf_counter() - started)
    finally:
        await direct.close()
        await proxied.close()
    return direct_times, proxied_times, errors


async def _throughput(proxy_port: int, concurrency: int, seconds: float) -> tuple[float, int]:
    host = f"{APP}.localhost"
    done = errors = 0
    stop = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal done, errors
        client = Client(proxy_port)
        try:
            while time.perf_counter() < stop:
                errors += (await client.request(host)).status != 200
                done += 1
        finally:
            await client.close()

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return done / (time.perf_counter() - started), errors


async def _wake(url: str, proxy_port: int, machine_id: str, how: str, rounds: int) -> tuple[list[float], int]:
    """Suspend (or stop) the machine, wait until the proxy's replica sees it, time one request's first byte."""
    client = await FleetClient.connect(url)
    times: list[float] = []
    errors = 0
    try:
        for _ in range(rounds):
            await (client.suspend(APP, machine_id) if how == "resume" else client.stop(APP, machine_id))
            await asyncio.sleep(0.3)  # the routing index's watch reaches the proxy
            fresh = Client(proxy_port)
            try:
                started = time.perf_counter()
                errors += (await fresh.request(f"{APP}.localhost")).status != 200
                times.append(time.perf_counter() - started)
            finally:
                await fresh.close()
    finally:
        await client.close()
    return times, errors


def run_proxy_bench(options: ProxyOptions, progress: Callable[[str], None] = lambda line: None) -> ProxyResult:
    spec = FleetSpec(regions=[REGION], workers_per_region=1, cpus=8, memory_mb=4096)
    with DevFleet(spec, progress=progress) as fleet:
        machine_id, machine_port = asyncio.run(_machine(fleet.url))
        proc, proxy_port = _start_proxy(fleet.url, fleet.root / "logs" / "proxy.log")
        try:
            progress(f"{options.requests} GETs direct and through the proxy, alternating")
            direct, proxied, errors = asyncio.run(_alternating(proxy_port, machine_port, options.requests))
            progress(f"{options.concurrency} keep-alive clients for {options.seconds:g} s through the proxy")
            rate, more = asyncio.run(_throughput(proxy_port, options.concurrency, options.seconds))
            progress(f"{options.wakes} requests to a suspended machine, {options.wakes} to a stopped one")
            resumes, e1 = asyncio.run(_wake(fleet.url, proxy_port, machine_id, "resume", options.wakes))
            starts, e2 = asyncio.run(_wake(fleet.url, proxy_port, machine_id, "start", options.wakes))
        finally:
            proc.terminate()
            proc.wait(10)
    d, p = summarize(direct), summarize(proxied)
    return ProxyResult(
        options=options,
        direct=d,
        proxied=p,
        overhead_p50_ms=round(p.p50_ms - d.p50_ms, 3),
        overhead_p99_ms=round(p.p99_ms - d.p99_ms, 3),
        requests_per_second=round(rate, 1),
        errors=errors + more + e1 + e2,
        after_resume=summarize(resumes),
        after_start=summarize(starts),
    )


def report(result: ProxyResult) -> Report:
    def row(what: str, lat: Latency) -> tuple[str, ...]:
        cells = (lat.p50_ms, lat.p90_ms, lat.p99_ms, lat.max_ms)
        return (what, str(lat.count), *(f"{v:.2f}" for v in cells))

    rows = (
        row("GET direct to the machine", result.direct),
        row("GET through the proxy", result.proxied),
        row("first byte, machine suspended", result.after_resume),
        row("first byte, machine stopped", result.after_start),
    )
    table = Table(
        title="edge proxy: one echo machine, one proxy process", columns=LATENCY_COLUMNS, align=LATENCY_ALIGN, rows=rows
    )
    notes = (
        f"proxy overhead: p50 +{result.overhead_p50_ms:.2f} ms, p99 +{result.overhead_p99_ms:.2f} ms "
        "(targets 0.5 / 2 ms)",
        f"throughput {result.requests_per_second:,.0f} req/s with {result.options.concurrency} keep-alive clients "
        f"(target 5,000), {result.errors} errors",
    )
    return Report(tables=(table,), notes=notes)
