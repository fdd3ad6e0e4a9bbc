"""`fauxmad bench console`: the web console's fleet page with 1,000 machines on 50 workers, in Chromium.

One fleet (reserve-only machines: `skip_launch`, so what is measured is the console and not process starts),
one `fauxmad api` process serving the console, and Debian's Chromium driven by Playwright:

- first paint: each load of the fleet page in a fresh tab, from navigation start to the first contentful paint
  (the browser's own `first-contentful-paint` entry), and the server's part of it (request sent to the first
  byte of the answer);
- event to screen: an action (a machine started over NATS, as the CLI does it) until the open fleet page has
  changed that machine's square (a MutationObserver records the moment, on the same clock).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.local.ports import free_port
from lab.bench import BenchError
from lab.bench.report import Report, Table, host_info, latency_table
from lab.bench.stats import Latency, summarize
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec

Progress = Callable[[str], None]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=16))
APPS = ("web", "api", "worker", "cron")
PAINT_LIMIT_MS = 300.0
EVENT_LIMIT_MS = 1000.0


class ConsoleOptions(msgspec.Struct, frozen=True, kw_only=True):
    machines: int = 1000
    workers: int = 50
    regions: int = 5
    loads: int = 20
    events: int = 20


class ConsoleResult(msgspec.Struct, kw_only=True):
    options: ConsoleOptions
    first_paint: Latency  # navigation start to first contentful paint
    server: Latency  # request sent to the answer's first byte
    page_kb: float
    event_to_screen: Latency
    paint_within_limit: bool
    event_within_limit: bool
    host: dict[str, object]


def _spec(options: ConsoleOptions) -> FleetSpec:
    per_region = -(-options.workers // options.regions)
    return FleetSpec(
        regions=[f"r{i}" for i in range(options.regions)],
        workers_per_region=per_region,
        cpus=64,
        memory_mb=65536,
        brokers=1,
        workers_per_process=max(1, per_region // 2),
    )


async def _create(client: FleetClient, options: ConsoleOptions, regions: list[str]) -> list[tuple[str, str]]:
    limit = asyncio.Semaphore(32)

    async def one(i: int) -> tuple[str, str]:
        app = APPS[i % len(APPS)]
        async with limit:
            request = CreateRequest(region=regions[i % len(regions)], config=CONFIG, skip_launch=True)
            return app, (await client.create(app, request)).id

    return await asyncio.gather(*(one(i) for i in range(options.machines)))


def _wait_listening(base: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise BenchError("the API process exited at start")
        try:
            with urllib.request.urlopen(base + "/openapi.json", timeout=5):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError("the API process never listened")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return str(reply.read().decode())


async def _view_has(base: str, count: int, timeout: float = 120.0) -> int:
    """Wait until the console's fleet page shows `count` machines (its view has caught up)."""
    deadline = time.monotonic() + timeout
    shown = 0
    while time.monotonic() < deadline:
        html = await asyncio.to_thread(_fetch, base + "/ui/")
        shown = html.count('class="m s-') - 8  # the legend's squares
        if shown >= count:
            return shown
        await asyncio.sleep(0.5)
    raise BenchError(f"the console showed {shown} of {count} machines after {timeout:.0f} s")


PAINT_JS = """() => {
  const nav = performance.getEntriesByType('navigation')[0];
  const fcp = performance.getEntriesByName('first-contentful-paint')[0];
  return {fcp: fcp ? fcp.startTime : null, server: nav.responseStart - nav.requestStart, bytes: nav.transferSize};
}"""

WATCH_JS = """(id) => {
  window.__changed = null;
  const chip = document.querySelector('[data-machine="' + id + '"]');
  new MutationObserver((_, obs) => { window.__changed = Date.now(); obs.disconnect(); })
    .observe(chip, {attributes: true});
}"""


async def _browse(
    base: str, client: FleetClient, machines: list[tuple[str, str]], options: ConsoleOptions, progress: Progress
) -> tuple[list[float], list[float], float, list[float]]:
    from playwright.async_api import async_playwright

    paints: list[float] = []
    servers: list[float] = []
    size = 0.0
    events: list[float] = []
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1400, "height": 900})
            progress(f"{options.loads} loads of the fleet page")
            for _ in range(options.loads + 1):  # the first load warms the cache (stylesheet, script)
                page = await context.new_page()
                await page.goto(base + "/ui/", wait_until="load")
                await page.wait_for_function("() => performance.getEntriesByName('first-contentful-paint').length > 0")
                got: dict[str, Any] = await page.evaluate(PAINT_JS)
                paints.append(float(got["fcp"]) / 1000)
                servers.append(float(got["server"]) / 1000)
                size = max(size, float(got["bytes"] or 0) / 1024)
                await page.close()
            paints, servers = paints[1:], servers[1:]
            progress(f"{options.events} events to an open fleet page")
            page = await context.new_page()
            await page.goto(base + "/ui/", wait_until="load")
            await page.wait_for_selector("body[data-live='1']")
            for app, machine_id in machines[: options.events]:
                await page.evaluate(WATCH_JS, machine_id)
                started = time.time() * 1000
                await client.start(app, machine_id)
                await page.wait_for_function("() => window.__changed !== null", timeout=30_000)
                events.append((float(await page.evaluate("window.__changed")) - started) / 1000)
        finally:
            await browser.close()
    return paints, servers, size, events


async def _measure(fleet: DevFleet, options: ConsoleOptions, progress: Progress) -> ConsoleResult:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "orchestrator.cli", "api", "--listen", f"127.0.0.1:{port}", "--nats", fleet.url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    client = await FleetClient.connect(fleet.url, "fauxmad-bench-console")
    try:
        await asyncio.to_thread(_wait_listening, base, proc)
        progress(f"{options.machines} machines (reserve only) on {options.workers} workers")
        machines = await _create(client, options, fleet.spec.regions)
        await _view_has(base, options.machines)
        paints, servers, size, events = await _browse(base, client, machines, options, progress)
    finally:
        await client.close()
        proc.terminate()
        proc.wait(10)
    first_paint, event = summarize(paints), summarize(events)
    return ConsoleResult(
        options=options,
        first_paint=first_paint,
        server=summarize(servers),
        page_kb=round(size, 1),
        event_to_screen=event,
        paint_within_limit=first_paint.p99_ms <= PAINT_LIMIT_MS,
        event_within_limit=event.max_ms <= EVENT_LIMIT_MS,
        host=host_info(),
    )


def run_console(options: ConsoleOptions, progress: Progress) -> ConsoleResult:
    if not Path(CHROMIUM).exists():
        raise BenchError(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)")
    spec = _spec(options)
    progress(f"starting a fleet: {len(spec.regions)} regions x {spec.workers_per_region} workers, 1 broker")
    with DevFleet(spec) as fleet:
        return asyncio.run(_measure(fleet, options, progress))


def report(result: ConsoleResult) -> Report:
    o = result.options
    latencies = latency_table(
        f"fleet page, {o.machines} machines on {o.workers} workers (Chromium)",
        [
            ("first contentful paint", result.first_paint),
            ("server (request to first byte)", result.server),
            ("event to screen (action to DOM change)", result.event_to_screen),
        ],
    )
    limits = Table(
        title="targets",
        columns=("what", "target", "met"),
        align="llr",
        rows=(
            ("first paint p99", f"<= {PAINT_LIMIT_MS:.0f} ms", "yes" if result.paint_within_limit else "no"),
            ("event to screen max", f"<= {EVENT_LIMIT_MS:.0f} ms", "yes" if result.event_within_limit else "no"),
        ),
    )
    return Report(tables=(latencies, limits), notes=(f"the fleet page is {result.page_kb:.0f} KB",))
