"""Machines that failed a request: avoided for a while by this proxy, and reported to the reconcilers.

A machine that refuses a connection (or drops one before any response byte) is avoided for a few
seconds (`avoid_for`) by this proxy; its kept connections are dropped, and the failure is published on
`fauxmad.v1.proxy.unreachable.<app>.<machine>` (once per spell of avoidance) for the reconcilers. But a
machine that has just started binds its port a moment after the worker says `started`: its refusals within
`ready_timeout` of when this proxy saw it start send the request elsewhere and nothing more (found on hosts:
the first requests after a deploy were refused by all three machines, two were then avoided for 5 s, and a
cut of the third host left requests nowhere to go).
Whether the request then goes to another machine is the connection handler's call (`server`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.edge import ProxyUnreachable
from orchestrator.proxy.config import ProxyConfig, machine_port
from orchestrator.proxy.metrics import ProxyMetrics
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Pool

_NONE: set[str] = set()  # no machine avoided (never changed)


class Failover:
    def __init__(
        self,
        config: ProxyConfig,
        routes: RouteTable,
        pool: Pool,
        metrics: ProxyMetrics,
        publish: Callable[[str, bytes], Any] | None,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.routes = routes
        self.pool = pool
        self.metrics = metrics
        self.publish = publish
        self.clock = clock
        self.bad: dict[str, float] = {}  # machine -> until when it is avoided (`clock`)

    def binding(self, machine_id: str) -> bool:
        """Whether a refusal by the machine may be its process not listening yet: this proxy saw it become
        `started` less than `ready_timeout` ago (the time it gives a machine it started itself to accept) and has
        not had a connection to it since (a machine that served and now refuses is dead, not late)."""
        return self.routes.started_within(machine_id, self.config.ready_timeout)

    def avoided(self) -> set[str]:
        """The machines avoided now (those whose time is up are forgotten)."""
        if not self.bad:
            return _NONE
        now = self.clock()
        for machine_id, until in list(self.bad.items()):
            if until <= now:
                del self.bad[machine_id]
        return set(self.bad)

    def failed(self, app: App, machine_id: str, why: str, *, refused: bool = False) -> None:
        """The machine failed a request: avoid it, drop its kept connections, say so (the first time). Not a
        refusal by a machine this proxy saw start less than `ready_timeout` ago (`binding`): the request that
        met it goes elsewhere, the next ones may try it again, and no reconciler is told."""
        entry = self.routes.entry(machine_id)
        if entry is not None:
            self.pool.drop(self.pool.address(entry, machine_port(app, entry)))
        self.metrics.refused.labels(app.name).inc()
        if refused and self.binding(machine_id):
            return
        first = machine_id not in self.bad
        self.bad[machine_id] = self.clock() + self.config.avoid_for
        if first and self.publish is not None and entry is not None:
            signal = ProxyUnreachable(
                app=app.name,
                machine_id=machine_id,
                worker_id=entry.worker_id,
                region=entry.region,
                proxy_region=self.config.region,
                error=why[:200],
                at=time.time(),
            )
            self.publish(subjects.proxy_unreachable(app.name, machine_id), msgspec.json.encode(signal))
