"""Autostop: machines no request has used for `idle_timeout` are stopped (or suspended, with `auto_stop =
"suspend"`: frozen with their memory, resumed by the next request in milliseconds), keeping
`min_machines_running`.

Beyond Fly (which stops one machine per region every few minutes): every idle machine past its timeout
goes at once, farthest region first, so the ones kept are the nearest. Idle means idle for this proxy:
no request in flight through it and none finished within the timeout, counted from when it last served
or from when this proxy first saw it started. The choice is a pure function; the loop around it only
asks the brokers to stop. With several proxies, each judges by its own traffic (README "The edge proxy").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from bus.errors import FauxmadError
from orchestrator.client import FleetClient
from orchestrator.proxy.choose import Candidate, region_order
from orchestrator.proxy.routes import RouteTable

log = logging.getLogger(__name__)


def idle_victims(
    machines: Sequence[Candidate],
    last_used: Mapping[str, float],
    now: float,
    idle_seconds: float,
    min_running: int,
    order: Sequence[str],
) -> list[str]:
    """The started machines to stop: idle (no load, unused for `idle_seconds`), at most as many as leaves
    `min_running` started, farthest region (in `order`) first, then by id."""
    started = [m for m in machines if m.state == "started"]
    budget = len(started) - min_running
    if budget <= 0:
        return []
    rank = {region: i for i, region in enumerate(order)}
    idle = [m for m in started if m.load == 0 and now - last_used.get(m.id, now) >= idle_seconds]
    idle.sort(key=lambda m: (-rank.get(m.region, len(rank)), m.id))
    return [m.id for m in idle[:budget]]


class IdleStopper:
    def __init__(
        self,
        routes: RouteTable,
        client: FleetClient,
        loads: Mapping[str, int],
        last_used: dict[str, float],
        *,
        region: str,
        latency: Mapping[str, float],
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_stopped: Callable[[str], None] = lambda app: None,
    ) -> None:
        self.routes = routes
        self.client = client
        self.loads = loads
        self.last_used = last_used  # shared with the proxy: it stamps a machine when a request ends
        self.region = region
        self.latency = latency
        self.clock = clock
        self.sleep = sleep
        self.on_stopped = on_stopped

    async def run(self, interval: float = 1.0) -> None:
        while True:
            await self.sleep(interval)
            try:
                await self.once()
            except Exception:
                log.exception("proxy: autostop round failed")

    async def once(self) -> list[str]:
        """One round over every app whose service says `auto_stop`; returns the machines stopped."""
        now = self.clock()
        stopped: list[str] = []
        for name in self.routes.apps.names():
            app = self.routes.app(name)
            if app is None or app.service.auto_stop == "off":
                continue
            machines = [Candidate(m.id, m.region, m.state, self.loads.get(m.id, 0)) for m in self.routes.machines(name)]
            for m in machines:
                if m.state == "started":
                    self.last_used.setdefault(m.id, now)  # first seen started: the clock starts now
            order = region_order({m.region for m in machines}, self.region, None, self.latency)
            victims = idle_victims(
                machines, self.last_used, now, app.service.idle_seconds, app.service.min_machines_running, order
            )
            for machine_id in victims:
                try:
                    if app.service.auto_stop == "suspend":
                        await self.client.suspend(name, machine_id)
                    else:
                        await self.client.stop(name, machine_id)
                except (FauxmadError, TimeoutError) as exc:
                    log.warning("proxy: %s idle %s failed: %s", app.service.auto_stop, machine_id, exc)
                    continue
                self.last_used.pop(machine_id, None)
                stopped.append(machine_id)
                self.on_stopped(name)
        return stopped
