"""Autostop: machines no request has used for `idle_timeout` are stopped (or suspended, with `auto_stop =
"suspend"`: frozen with their memory, resumed by the next request in milliseconds), keeping
`min_machines_running` started in each region (the floor `reconcile.ownership` sets for the operator too,
which then leaves the machines stopped here alone).

Beyond Fly (which stops one machine per region every few minutes): every idle machine past its timeout
goes at once, farthest region first. Idle means idle for every proxy: no request in flight through this
one (nor waiting for the machine's start: `Waker.waking`) and none finished within the timeout, counted from
when it last served or from when this proxy saw it started (each start again: what it knew from before a stop is
forgotten), and no other proxy said it served the machine meanwhile (`Activity`: each proxy publishes, once a
round, the machines it used or woke since the last one). The choice is a pure function; the loop around it only
asks the brokers to stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from bus.contract.errors import FauxmadError
from orchestrator.apps.ownership import RUNNING
from orchestrator.client import FleetClient
from orchestrator.proxy.choose import Candidate, region_order
from orchestrator.proxy.routes import RouteTable

log = logging.getLogger(__name__)


def idle_victims(
    machines: Sequence[Candidate],
    last_used: Mapping[str, float],
    now: float,
    idle_seconds: float,
    may_stop: Callable[[str, int], int],
    order: Sequence[str],
) -> list[str]:
    """The started machines to stop: idle (no load, unused for `idle_seconds`), in each region at most
    `may_stop(region, running)` of them (`RegionRange.to_stop`), farthest region (in `order`) first, then by id."""
    rank = {region: i for i, region in enumerate(order)}
    victims: list[Candidate] = []
    for region in sorted({m.region for m in machines}):
        here = [m for m in machines if m.region == region]
        budget = may_stop(region, sum(1 for m in here if m.state in RUNNING))
        idle = [
            m for m in here if m.state == "started" and m.load == 0 and now - last_used.get(m.id, now) >= idle_seconds
        ]
        victims += sorted(idle, key=lambda m: m.id)[: max(budget, 0)]
    victims.sort(key=lambda m: (-rank.get(m.region, len(rank)), m.id))
    return [m.id for m in victims]


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
        on_stopped: Callable[[str, str, str], None] = lambda app, machine_id, why: None,
        share: Callable[[str, list[str]], None] | None = None,
        waking: Callable[[], AbstractSet[str]] = frozenset,
    ) -> None:
        self.routes = routes
        self.client = client
        self.loads = loads
        self.last_used = last_used  # shared with the proxy: it stamps a machine when a request ends
        self.region = region
        self.latency = latency
        self.clock = clock
        self.sleep = sleep
        self.on_stopped = on_stopped  # (app, machine id, what and why) once the brokers stopped or suspended it
        self.share = share  # tells the other proxies which of an app's machines this one used since the last round
        self.waking = waking  # the machines requests here wait for (`Waker.waking`): in use, though not yet reached
        self.peer_used: dict[str, float] = {}  # machine id -> when another proxy last said it used it
        self._reported = clock()

    def heard(self, machines: Iterable[str]) -> None:
        """Another proxy used these machines lately: they are not idle."""
        now = self.clock()
        for machine_id in machines:
            self.peer_used[machine_id] = now

    def note_states(self, machines: Iterable[Candidate], now: float) -> None:
        """A machine's idle clock starts when this proxy first sees it started, and again at each start after a
        stop: what it knew of the machine's use before the stop (its own, the other proxies') is forgotten. CI105:
        a proxy that had not stopped the machine itself kept its use from the run before, and stopped the machine
        a moment after another proxy started it for a request."""
        for m in machines:
            if m.state == "started":
                self.last_used.setdefault(m.id, now)
            else:
                self.last_used.pop(m.id, None)
                self.peer_used.pop(m.id, None)

    def _used_anywhere(self) -> dict[str, float]:
        """When each machine was last used through this proxy or another (the later of the two); a machine first
        seen started this round is in neither, and counts as used now (`idle_victims`' default)."""
        used = dict(self.last_used)
        for machine_id, at in self.peer_used.items():
            used[machine_id] = max(at, used.get(machine_id, at))
        return used

    def _report(self, app: str, machines: Sequence[Candidate], since: float) -> None:
        if self.share is None:
            return
        used = [m.id for m in machines if m.load > 0 or self.last_used.get(m.id, since) > since]
        if used:
            self.share(app, used)

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
        since, self._reported = self._reported, now
        stopped: list[str] = []
        waking = self.waking()
        for name in self.routes.apps.names():
            app = self.routes.app(name)
            if app is None or app.service.auto_stop == "off":
                continue
            machines = [
                Candidate(m.id, m.region, m.state, self.loads.get(m.id, 0) + (m.id in waking))
                for m in self.routes.machines(name)
            ]
            self._report(name, machines, since)
            self.note_states(machines, now)
            order = region_order({m.region for m in machines}, self.region, None, self.latency)
            used = self._used_anywhere()  # per app: a request that ends while this round stops others counts
            victims = idle_victims(machines, used, now, app.service.idle_seconds, app.may_stop, order)
            for machine_id in victims:
                try:
                    if app.service.auto_stop == "suspend":
                        await self.client.suspend(name, machine_id)
                    else:
                        await self.client.stop(name, machine_id)
                except (FauxmadError, TimeoutError) as exc:
                    log.warning("proxy: %s idle %s failed: %s", app.service.auto_stop, machine_id, exc)
                    continue
                idle = now - used.get(machine_id, now)
                self.last_used.pop(machine_id, None)
                self.peer_used.pop(machine_id, None)
                stopped.append(machine_id)
                region = next(m.region for m in machines if m.id == machine_id)
                done = "suspended" if app.service.auto_stop == "suspend" else "stopped"
                why = f"{done} in {region}: no request for {idle:.0f}s (idle_timeout {app.service.idle_seconds:g}s)"
                self.on_stopped(name, machine_id, why)
        return stopped
