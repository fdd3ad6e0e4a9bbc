"""`fauxmad bench proxy`: what the edge costs and how fast it wakes machines, on a real fleet and proxy.

One dev fleet (one worker), one app with an `[http_service]`, one machine running examples/echo/app.py,
one `fauxmad proxy` process. Measured in one run: the same GET sent directly to the machine and through
the proxy (keep-alive, one at a time, alternating, so both see the same machine and the same noise);
requests per second through the proxy with `concurrency` keep-alive clients; and the first byte of a
request that finds the machine suspended (the proxy resumes it) or stopped (the proxy starts it).

The wakes are timed twice: with the echo app, whose start is mostly Python importing asyncio, and with
examples/echo/tiny.py (`socket` only, `python3 -S`), listening a few ms after its interpreter starts, so the
platform's own part of a start shows. The tiny app also times a create inside the request: an app with
`auto_create` and no machine, whose machine is destroyed after each round. Where the host has a C compiler
(`cc`), the start and the create are timed a third time with examples/echo/tiny.c, which listens about a
millisecond after its exec: what is left is the platform's own part of a start.

`hosts`: the same across hosts (`orchestrator.devhosts`, root only): nats-server and the edge (`fauxmad proxy`,
the one a fleet of hosts runs) on host a, the worker and its machines on host b, a bridge between them. A
machine listens on its host's loopback only, so the alternating GETs are sent from a client on host b: directly
to the machine there, and through the edge on host a, which reaches the machine through b's worker (the
backhaul): two crossings of the bridge and the worker's relay, what an edge on another host adds. The wakes,
the creates and the req/s are sent from this machine (the laptop) to the edge on host a.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bus.contract.fleet import CreateRequest
from bus.local.ports import free_port
from bus.transport.connection import connect
from bus.transport.jetstream import ensure_fleet_resources
from lab.bench import BenchError
from lab.bench.cpu import clock_ticks_per_second, parse_stat
from lab.bench.http_client import Client
from lab.bench.report import LATENCY_ALIGN, LATENCY_COLUMNS, Report, Table
from lab.bench.stats import Latency, summarize
from orchestrator.apps.releases import Releases
from orchestrator.apps.spec import PRIMARY, parse_spec
from orchestrator.apps.store import KVReleaseStore
from orchestrator.client import FleetClient
from orchestrator.devfleet import ROOT, DevFleet, FleetSpec
from orchestrator.proxy.upstream import connect_when_up

ECHO = Path(__file__).resolve().parents[2] / "examples" / "echo" / "app.py"
TINY = ECHO.with_name("tiny.py")
TINY_C = ECHO.with_name("tiny.c")
APP = "benchedge"
TINY_APP = "benchtiny"
CREATE_APP = "benchcreate"
NATIVE_APP = "benchnative"
NATIVE_CREATE_APP = "benchnativecreate"
REGION = "edge"


class ProxyOptions(msgspec.Struct, frozen=True, kw_only=True):
    requests: int = 2000
    concurrency: int = 32
    seconds: float = 3.0
    wakes: int = 10
    # every machine through its worker's backhaul (`fauxmad proxy --backhaul always`), as an edge on another host
    # reaches it: what the backhaul adds, measured on one host
    backhaul: bool = False
    # the edge on host a and the machine on host b (network namespaces on a bridge): what crossing hosts adds
    hosts: bool = False


class Throughput(msgspec.Struct, frozen=True, kw_only=True):
    requests_per_second: float
    errors: int
    load_generator: str  # "wrk", or "asyncio client" where wrk is not installed
    upstream: str  # the app behind the proxy
    proxy_cpu_us_per_request: float  # the proxy process's CPU time (user + system) per request


class ProxyResult(msgspec.Struct, kw_only=True):
    options: ProxyOptions
    direct: Latency
    proxied: Latency
    overhead_p50_ms: float
    overhead_p99_ms: float
    requests_per_second: float
    throughput: Throughput
    errors: int
    after_resume: Latency
    after_start: Latency
    tiny_after_resume: Latency | None = None
    tiny_after_start: Latency | None = None
    tiny_after_create: Latency | None = None
    native_after_resume: Latency | None = None
    native_after_start: Latency | None = None
    native_after_create: Latency | None = None


def _start_proxy(
    url: str, log: Path, *, backhaul: bool = False, tree: Path | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """A `fauxmad proxy` on a free port, once it listens; `tree`: run another checkout's code (`--against`)."""
    port = free_port()
    argv = [sys.executable, "-m", "orchestrator.cli", "proxy", "--listen", f"127.0.0.1:{port}", "--region", REGION]
    if backhaul:
        argv += ["--backhaul", "always"]
    env = dict(os.environ) if tree is None else dict(os.environ, PYTHONPATH=str(tree))
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [*argv, "--nats", url], stdout=out, stderr=out, env=env, cwd=None if tree is None else str(tree)
        )
    deadline = time.monotonic() + 20
    while b"listening on" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise BenchError(f"the proxy{f' of {tree}' if tree else ''} did not start: {log.read_text()[-500:]}")
        time.sleep(0.05)
    return proc, port


async def _publish(url: str, app: str, cmd: str, *, count: int = 1, auto_create: bool = False) -> tuple[Any, int]:
    """Publish an app (as a deploy would); (its spec, the release's version)."""
    service = "[http_service]\nauto_start = true\n" + ("auto_create = true\n" if auto_create else "")
    spec = parse_spec(
        f'app = "{app}"\ncmd = {cmd}\n[guest]\nmemory_mb = 64\n[regions]\n{REGION} = {count}\n'
        f"{service}[http_service.concurrency]\nsoft_limit = 1000\nhard_limit = 1000\n"
    )
    nc = await connect(url, "fauxmad-bench-proxy")
    try:
        releases = Releases(KVReleaseStore((await ensure_fleet_resources(nc.jetstream())).apps))
        release = await releases.create(spec, "bench proxy")
        await releases.point(app, release.version)
    finally:
        await nc.close()
    return spec, release.version


async def _machine(
    url: str, app: str = APP, cmd: str = f'["python3", "{ECHO}"]', *, edge: tuple[str, int] | None = None
) -> tuple[str, int]:
    """Publish the app and start its one machine; (id, port) once it listens on this host's loopback, or with
    `edge` (address, port: the machine is on another host) once a GET through that edge answers 200."""
    spec, version = await _publish(url, app, cmd)
    client = await FleetClient.connect(url)
    try:
        config = spec.machine_config(version, PRIMARY)
        machine = await client.create(app, CreateRequest(region=REGION, config=config))
    finally:
        await client.close()
    assert machine.port is not None
    if edge is not None:
        deadline = time.monotonic() + 20
        while not (await _first_byte(edge[1], app, edge[0]))[1]:
            if time.monotonic() > deadline:
                raise BenchError(f"the {app} machine never answered through the edge at {edge[0]}:{edge[1]}")
            await asyncio.sleep(0.2)
        return machine.id, machine.port
    conn = await connect_when_up(("127.0.0.1", machine.port), 10.0)
    if conn is None:
        raise BenchError(f"the {app} machine never listened on {machine.port}")
    conn.close()
    return machine.id, machine.port


async def _alternating(
    proxy_port: int, machine_port: int, n: int, proxy_address: str = "127.0.0.1"
) -> tuple[list[float], list[float], int]:
    direct, proxied, errors = Client(machine_port), Client(proxy_port, proxy_address), 0
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


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time, from /proc (0 where there is none)."""
    try:
        _, utime, stime = parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return 0.0
    return (utime + stime) / clock_ticks_per_second()


def _throughput(
    proxy: subprocess.Popen[bytes],
    proxy_port: int,
    app: str,
    upstream: str,
    options: ProxyOptions,
    proxy_address: str = "127.0.0.1",
) -> Throughput:
    """Keep-alive clients as fast as the proxy answers: wrk where it is installed (a C load generator leaves
    the proxy the CPU a Python client would take on a small host), else the asyncio client."""
    wrk = shutil.which("wrk")
    cpu_before, started = _cpu_seconds(proxy.pid), time.perf_counter()
    if wrk is not None:
        rate, errors = _wrk(wrk, proxy_port, app, options.concurrency, options.seconds, proxy_address)
    else:
        rate, errors = asyncio.run(
            _asyncio_clients(proxy_port, app, options.concurrency, options.seconds, proxy_address)
        )
    cpu = _cpu_seconds(proxy.pid) - cpu_before
    requests = rate * (time.perf_counter() - started)
    return Throughput(
        requests_per_second=round(rate, 1),
        errors=errors,
        load_generator="wrk" if wrk is not None else "asyncio client",
        upstream=upstream,
        proxy_cpu_us_per_request=round(1e6 * cpu / requests, 1) if requests else 0.0,
    )


def _wrk(
    wrk: str, proxy_port: int, app: str, concurrency: int, seconds: float, address: str = "127.0.0.1"
) -> tuple[float, int]:
    """(requests/s, errors) from one wrk run: non-2xx answers and socket errors count as errors."""
    import re

    argv = [wrk, "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "-H", f"Host: {app}.localhost"]
    done = subprocess.run([*argv, f"http://{address}:{proxy_port}/"], capture_output=True, text=True, timeout=120)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", done.stdout)
    if done.returncode != 0 or rate is None:
        raise BenchError(f"wrk failed: {(done.stderr or done.stdout).strip()[-300:]}")
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", done.stdout))
    socket = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", done.stdout)
    errors += sum(int(n) for n in socket.groups()) if socket else 0
    return float(rate.group(1)), errors


async def _asyncio_clients(
    proxy_port: int, app: str, concurrency: int, seconds: float, address: str = "127.0.0.1"
) -> tuple[float, int]:
    host = f"{app}.localhost"
    done = errors = 0
    stop = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal done, errors
        client = Client(proxy_port, address)
        try:
            while time.perf_counter() < stop:
                errors += (await client.request(host)).status != 200
                done += 1
        finally:
            await client.close()

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return done / (time.perf_counter() - started), errors


async def _wake(
    url: str, proxy_port: int, machine_id: str, how: str, rounds: int, app: str = APP, address: str = "127.0.0.1"
) -> tuple[list[float], int]:
    """Suspend (or stop) the machine, wait until the proxy's replica sees it, time one request's first byte."""
    client = await FleetClient.connect(url)
    times: list[float] = []
    errors = 0
    try:
        for _ in range(rounds):
            await (client.suspend(app, machine_id) if how == "resume" else client.stop(app, machine_id))
            await asyncio.sleep(0.3)  # the routing index's watch reaches the proxy
            took, ok = await _first_byte(proxy_port, app, address)
            times.append(took)
            errors += not ok
    finally:
        await client.close()
    return times, errors


async def _first_byte(proxy_port: int, app: str, address: str = "127.0.0.1") -> tuple[float, bool]:
    """One GET through the proxy on a fresh connection: (seconds to its whole answer, whether it was a 200)."""
    fresh = Client(proxy_port, address)
    try:
        started = time.perf_counter()
        ok = (await fresh.request(f"{app}.localhost")).status == 200
        return time.perf_counter() - started, ok
    finally:
        await fresh.close()


def _compile_tiny(into: Path) -> Path | None:
    """examples/echo/tiny.c built with the host's `cc` (None without one, or if it does not build)."""
    compiler = shutil.which("cc")
    if compiler is None:
        return None
    binary = into / "tiny"
    built = subprocess.run([compiler, "-O2", "-o", str(binary), str(TINY_C)], capture_output=True, timeout=120)
    return binary if built.returncode == 0 else None


async def _creates(
    url: str,
    proxy_port: int,
    rounds: int,
    app: str = CREATE_APP,
    cmd: str = f'["python3", "-S", "{TINY}"]',
    address: str = "127.0.0.1",
) -> tuple[list[float], int]:
    """An app with `auto_create` and no machine: time the first byte of a request that creates one, destroy it."""
    await _publish(url, app, cmd, count=0, auto_create=True)
    await asyncio.sleep(0.3)  # the apps watch reaches the proxy
    client = await FleetClient.connect(url)
    times: list[float] = []
    errors = 0
    try:
        for _ in range(rounds):
            took, ok = await _first_byte(proxy_port, app, address)
            times.append(took)
            errors += not ok
            for machine in await client.list(app):
                if machine.state != "destroyed":
                    await client.destroy(app, machine.id, force=True)
            await asyncio.sleep(0.3)  # the proxy sees the region empty again
    finally:
        await client.close()
    return times, errors


def _alternating_on_host(fleet: DevFleet, machine_port: int, edge: tuple[str, int], n: int) -> tuple[Any, ...]:
    """`_alternating` run by a client on the machine's host (host b), to the machine there and through the edge."""
    assert fleet.hosts is not None
    host = fleet.placement[f"worker-{fleet.worker_ids[0]}"]
    argv = [sys.executable, "-m", "lab.bench.proxy", edge[0], str(edge[1]), str(machine_port), str(n)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(host.command(argv), capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))
    if done.returncode != 0:
        raise BenchError(f"the client on host {host.name} failed: {done.stderr.strip()[-500:]}")
    direct, proxied, errors = msgspec.json.decode(done.stdout.strip().splitlines()[-1])
    return direct, proxied, errors


def run_proxy_bench(options: ProxyOptions, progress: Callable[[str], None] = lambda line: None) -> ProxyResult:
    spec = FleetSpec(regions=[REGION], workers_per_region=1, cpus=8, memory_mb=4096, hosts=2 if options.hosts else 0)
    with DevFleet(spec, progress=progress) as fleet:
        own_proxy = not options.hosts
        if options.hosts:  # the edge a fleet of hosts runs: `fauxmad proxy` on host a
            assert fleet.edge is not None
            address, port = fleet.edge.rsplit(":", 1)
            proc, proxy_port, edge = dict(fleet.processes)["proxy"], int(port), (address, int(port))
        else:
            proc, proxy_port = _start_proxy(fleet.url, fleet.root / "logs" / "proxy.log", backhaul=options.backhaul)
            address, edge = "127.0.0.1", None
        try:
            machine_id, machine_port = asyncio.run(_machine(fleet.url, edge=edge))
            if edge is not None:
                progress(f"{options.requests} GETs from host b direct and through the edge on host a, alternating")
                direct, proxied, errors = _alternating_on_host(fleet, machine_port, edge, options.requests)
            else:
                progress(f"{options.requests} GETs direct and through the proxy, alternating")
                direct, proxied, errors = asyncio.run(_alternating(proxy_port, machine_port, options.requests))
            binary = _compile_tiny(fleet.root)
            native_id = None
            if binary is not None:  # the cheapest upstream, so the throughput is the proxy's
                native_id, _ = asyncio.run(_machine(fleet.url, NATIVE_APP, f'["{binary}"]', edge=edge))
            upstream, app = ("examples/echo/tiny.c", NATIVE_APP) if native_id else ("examples/echo/app.py", APP)
            generator = "wrk" if shutil.which("wrk") else "an asyncio client (no wrk installed)"
            progress(
                f"{options.concurrency} keep-alive clients for {options.seconds:g} s through the proxy to {upstream}, "
                f"from {generator}"
            )
            throughput = _throughput(proc, proxy_port, app, upstream, options, address)
            progress(f"{options.wakes} requests to a suspended machine, {options.wakes} to a stopped one")
            wakes = options.wakes
            resumes, e1 = asyncio.run(_wake(fleet.url, proxy_port, machine_id, "resume", wakes, APP, address))
            starts, e2 = asyncio.run(_wake(fleet.url, proxy_port, machine_id, "start", wakes, APP, address))
            progress(f"the same with a machine of examples/echo/tiny.py, and {wakes} creates in a request")
            tiny_id, _ = asyncio.run(_machine(fleet.url, TINY_APP, f'["python3", "-S", "{TINY}"]', edge=edge))
            tiny_resumes, e3 = asyncio.run(_wake(fleet.url, proxy_port, tiny_id, "resume", wakes, TINY_APP, address))
            tiny_starts, e4 = asyncio.run(_wake(fleet.url, proxy_port, tiny_id, "start", wakes, TINY_APP, address))
            creates, e5 = asyncio.run(
                _creates(fleet.url, proxy_port, wakes, CREATE_APP, f'["python3", "-S", "{TINY}"]', address)
            )
            native_resumes = native_starts = native_creates = None
            if native_id is not None:
                progress("the same with a machine of examples/echo/tiny.c, built with cc")
                native_resumes, e8 = asyncio.run(
                    _wake(fleet.url, proxy_port, native_id, "resume", wakes, NATIVE_APP, address)
                )
                native_starts, e6 = asyncio.run(
                    _wake(fleet.url, proxy_port, native_id, "start", wakes, NATIVE_APP, address)
                )
                native_creates, e7 = asyncio.run(
                    _creates(fleet.url, proxy_port, wakes, NATIVE_CREATE_APP, f'["{binary}"]', address)
                )
                e5 += e6 + e7 + e8
            else:
                progress("no C compiler (cc): the compiled app's start is not measured")
        finally:
            if own_proxy:
                proc.terminate()
                proc.wait(10)
    d, p = summarize(direct), summarize(proxied)
    return ProxyResult(
        options=options,
        direct=d,
        proxied=p,
        overhead_p50_ms=round(p.p50_ms - d.p50_ms, 3),
        overhead_p99_ms=round(p.p99_ms - d.p99_ms, 3),
        requests_per_second=throughput.requests_per_second,
        throughput=throughput,
        errors=errors + throughput.errors + e1 + e2 + e3 + e4 + e5,
        after_resume=summarize(resumes),
        after_start=summarize(starts),
        tiny_after_resume=summarize(tiny_resumes),
        tiny_after_start=summarize(tiny_starts),
        tiny_after_create=summarize(creates),
        native_after_resume=summarize(native_resumes) if native_resumes else None,
        native_after_start=summarize(native_starts) if native_starts else None,
        native_after_create=summarize(native_creates) if native_creates else None,
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
        *(
            row(what, lat)
            for what, lat in (
                ("tiny app: first byte, suspended", result.tiny_after_resume),
                ("tiny app: first byte, stopped", result.tiny_after_start),
                ("tiny app: first byte, created", result.tiny_after_create),
                ("C app: first byte, suspended", result.native_after_resume),
                ("C app: first byte, stopped", result.native_after_start),
                ("C app: first byte, created", result.native_after_create),
            )
            if lat is not None
        ),
    )
    path = " (through the worker's backhaul)" if result.options.backhaul else ""
    if result.options.hosts:
        path = " across hosts (the edge on host a, the machine on host b, through b's worker over the bridge)"
    table = Table(
        title=f"edge proxy: one echo machine, one proxy process{path}",
        columns=LATENCY_COLUMNS,
        align=LATENCY_ALIGN,
        rows=rows,
    )
    notes = (
        f"proxy overhead: p50 +{result.overhead_p50_ms:.2f} ms, p99 +{result.overhead_p99_ms:.2f} ms "
        "(targets 0.5 / 2 ms)",
        f"throughput {result.requests_per_second:,.0f} req/s with {result.options.concurrency} keep-alive clients "
        f"(target 5,000) from {result.throughput.load_generator} to {result.throughput.upstream}; the proxy's CPU "
        f"{result.throughput.proxy_cpu_us_per_request:.0f} us a request; {result.errors} errors",
    )
    return Report(tables=(table,), notes=notes)


def _client_on_host(argv: list[str]) -> None:
    """`python -m lab.bench.proxy EDGE_ADDRESS EDGE_PORT MACHINE_PORT N`, run inside the machine's host: the
    alternating GETs, printed as one JSON line [direct, proxied, errors]."""
    address, edge_port, machine_port, n = argv[0], int(argv[1]), int(argv[2]), int(argv[3])

    async def run() -> tuple[list[float], list[float], int]:
        conn = await connect_when_up(("127.0.0.1", machine_port), 10.0)
        if conn is None:
            raise BenchError(f"the machine never listened on {machine_port} on this host")
        conn.close()
        return await _alternating(edge_port, machine_port, n, address)

    sys.stdout.write(msgspec.json.encode(asyncio.run(run())).decode() + "\n")


if __name__ == "__main__":
    _client_on_host(sys.argv[1:])
