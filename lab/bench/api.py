"""`fauxmad bench api`: what the HTTP API adds over the bus, and how many requests one API process answers.

One run, one fleet: creates (reserve only, so process starts do not drown the difference) alternate
between HTTP (through a `fauxmad api` process) and NATS (FleetClient), then gets at concurrency C
through the API for requests per second. The API is its own process, as in production. The HTTP side
uses the bench's raw keep-alive client (`http_client`, as the proxy bench does), as thin as nats-py on
the NATS side, so the difference is the API and not a client library's framing.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable

import aiohttp
import msgspec
import uvloop

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.local.ports import free_port
from lab.bench import BenchError
from lab.bench.http_client import Client
from lab.bench.report import Report, Table, host_info, latency_table
from lab.bench.stats import Latency, summarize
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec

Progress = Callable[[str], None]
CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=1))
HOST = "127.0.0.1"
JSON_TYPE = {"content-type": "application/json"}
BODY = {"region": "mad", "skip_launch": True, "config": {"init": {"cmd": ["sleep", "300"]}, "guest": {"memory_mb": 1}}}


class ApiOptions(msgspec.Struct, frozen=True, kw_only=True):
    creates: int = 200
    gets: int = 5000
    concurrency: int = 32


class ApiResult(msgspec.Struct, kw_only=True):
    options: ApiOptions
    http_create: Latency
    nats_create: Latency
    added_p50_ms: float
    gets_per_second: float
    http_get: Latency
    host: dict[str, object]


async def _ready(http: aiohttp.ClientSession, base: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(400):
        if proc.poll() is not None:
            raise BenchError("the API process exited at start")
        try:
            async with http.get(base + "/openapi.json") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)
    raise BenchError("the API process never listened")


async def _creates(http: Client, client: FleetClient, n: int) -> tuple[list[float], list[float], list[str]]:
    via_http: list[float] = []
    via_nats: list[float] = []
    ids: list[str] = []
    body = msgspec.json.encode(BODY)
    for _ in range(n):
        t0 = time.perf_counter()
        resp = await http.request(HOST, "/v1/apps/bench/machines", method="POST", headers=JSON_TYPE, body=body)
        via_http.append(time.perf_counter() - t0)
        if resp.status != 200:
            raise BenchError(f"HTTP create: {resp.status} {resp.body[:200]!r}")
        ids.append(resp.json()["id"])
        t0 = time.perf_counter()
        machine = await client.create("bench", CreateRequest(region="mad", config=CONFIG, skip_launch=True))
        via_nats.append(time.perf_counter() - t0)
        ids.append(machine.id)
    return via_http, via_nats, ids


async def _gets(port: int, ids: list[str], options: ApiOptions) -> tuple[list[float], float]:
    samples: list[float] = []
    todo = iter(range(options.gets))

    async def one_client() -> None:
        http = Client(port)
        try:
            for i in todo:
                t0 = time.perf_counter()
                resp = await http.request(HOST, f"/v1/apps/bench/machines/{ids[i % len(ids)]}")
                if resp.status != 200:
                    raise BenchError(f"HTTP get: {resp.status}")
                samples.append(time.perf_counter() - t0)
        finally:
            await http.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(options.concurrency)))
    return samples, options.gets / (time.perf_counter() - t0)


async def _measure(fleet: DevFleet, options: ApiOptions, progress: Progress) -> ApiResult:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "orchestrator.cli", "api", "--listen", f"127.0.0.1:{port}", "--nats", fleet.url]
    proc = subprocess.Popen(cmd)
    client = await FleetClient.connect(fleet.url, "fauxmad-bench")
    http = Client(port)
    try:
        async with aiohttp.ClientSession() as session:
            await _ready(session, base, proc)
        progress(f"{options.creates} creates each way, alternating HTTP and NATS")
        via_http, via_nats, ids = await _creates(http, client, options.creates)
        progress(f"{options.gets} gets through the API at concurrency {options.concurrency}")
        samples, rate = await _gets(port, ids, options)
        for machine_id in ids:
            await client.destroy("bench", machine_id, force=True)
    finally:
        await http.close()
        await client.close()
        proc.terminate()
        proc.wait(10)
    http_create, nats_create = summarize(via_http), summarize(via_nats)
    return ApiResult(
        options=options,
        http_create=http_create,
        nats_create=nats_create,
        added_p50_ms=round(http_create.p50_ms - nats_create.p50_ms, 3),
        gets_per_second=round(rate, 1),
        http_get=summarize(samples),
        host=host_info(),
    )


def run_api(options: ApiOptions, progress: Progress) -> ApiResult:
    spec = FleetSpec(regions=["mad"], workers_per_region=2, cpus=100_000, memory_mb=10_000_000, brokers=1)
    progress("starting a fleet: nats-server, 2 workers, 1 broker")
    with DevFleet(spec) as fleet:
        return uvloop.run(_measure(fleet, options, progress))


def report(result: ApiResult) -> Report:
    latencies = latency_table(
        "create (reserve only), same run",
        [("HTTP (fauxmad api)", result.http_create), ("NATS (FleetClient)", result.nats_create)],
    )
    rows = (("HTTP get", f"{result.options.concurrency}", f"{result.gets_per_second:.0f}"),)
    rate = Table(title="one API process", columns=("what", "concurrency", "req/s"), align="lrr", rows=rows)
    note = f"HTTP adds {result.added_p50_ms:.3f} ms at p50 over the NATS create"
    return Report(tables=(latencies, rate, latency_table("HTTP get", [("get", result.http_get)])), notes=(note,))
