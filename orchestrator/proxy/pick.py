"""Which machine takes a request, made ready for it: the choice (`choose`) over the route table, then
waking what it names, and this proxy's count of what each machine has in flight.

The choice is `choose`'s; here is what feeds it (the app's policy, made once per release, the
candidates with this proxy's loads, the region order, the machines `failover` avoids) and what its
answer asks for: a started machine (once this proxy's start of it is done), a start or resume
(`wake`; `ahead` for a suspended machine and a request that changes nothing), a create, a bounded wait
for a slot when every machine is at its hard limit (503 after it), or, when every machine refused,
the last resort of a machine that has not bound its port yet.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from bus.contract.machines import MachineIndexEntry
from orchestrator.proxy.ahead import AHEAD, resume_ahead
from orchestrator.proxy.choose import (
    WAKEABLE,
    Candidate,
    Create,
    Decision,
    NoMachine,
    Policy,
    Route,
    Start,
    Wait,
    choose,
    region_order,
)
from orchestrator.proxy.config import ProxyConfig, machine_port
from orchestrator.proxy.exchange import Exchange, Refused
from orchestrator.proxy.failover import Failover
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Pool, connect_when_up
from orchestrator.proxy.wake import WakeError, Waker

log = logging.getLogger(__name__)


class Picker:
    def __init__(
        self,
        config: ProxyConfig,
        routes: RouteTable,
        waker: Waker | None,
        pool: Pool,
        failover: Failover,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self.config = config
        self.routes = routes
        self.waker = waker
        self.pool = pool
        self.failover = failover
        self.clock = clock
        self.rng = rng
        self.loads: dict[str, int] = {}  # requests (or connections) in flight per machine
        self.last_used: dict[str, float] = {}  # when a machine's last request ended (`IdleStopper` reads it)
        self._freed: dict[str, asyncio.Event] = {}
        self._queued: dict[str, int] = {}
        self._orders: dict[tuple[frozenset[str], str | None], list[str]] = {}
        self._policies: dict[str, tuple[App, Policy]] = {}

    def routable(self, app: str, machine_id: str) -> MachineIndexEntry | None:
        """The machine's entry if it may take a request of `app` now (started, not avoided), else None."""
        entry = self.routes.entry(machine_id)
        if entry is None or entry.app != app or entry.state != "started" or machine_id in self.failover.bad:
            return None
        return entry

    def _candidates(self, app: App) -> list[Candidate]:
        starting = self.waker.starting if self.waker is not None else {}
        loads = self.loads
        return [
            Candidate(m.id, m.region, "started" if m.id in starting else m.state, loads.get(m.id, 0))
            for m in self.routes.machines(app.name)
        ]

    def _policy(self, app: App) -> Policy:
        """The app's choice policy, made once per release the route table holds (`App` is replaced on change)."""
        held = self._policies.get(app.name)
        if held is not None and held[0] is app:
            return held[1]
        service = app.service
        can_wake = self.waker is not None
        policy = Policy(
            soft_limit=service.concurrency.soft_limit,
            hard_limit=service.concurrency.hard_limit,
            auto_start=service.auto_start and can_wake,
            auto_create=service.auto_create and can_wake and app.spec is not None,
            max_per_region=app.region_range("").most,  # a region the release does not name
            most_in={region: app.region_range(region).most for region in (app.spec.regions if app.spec else ())},
        )
        self._policies[app.name] = (app, policy)
        return policy

    async def pick(self, app: App, prefer: str | None, avoid: set[str], deadline: float, ex: Exchange) -> str:
        """A machine ready for this request (`avoid`: those that failed it), or `Refused`."""
        policy = self._policy(app)
        looked_again = False
        not_woken: set[str] = set()  # machines whose start failed for this request: not started again by it
        while True:
            candidates = self._candidates(app)
            decision = self._one(candidates, policy, avoid) or self._choose(candidates, policy, prefer, avoid)
            match decision:
                case Route(machine_id):
                    if await self._started(machine_id):
                        return machine_id
                    avoid.add(machine_id)
                case Start(machine_id):
                    if await self._woken(app, machine_id, ex):
                        return machine_id
                    avoid.add(machine_id)
                    not_woken.add(machine_id)
                case Create(region):
                    assert self.waker is not None
                    try:
                        return (await self.waker.create(app, region)).id
                    except WakeError as exc:
                        raise Refused(502, f"no machine of {app.name} could take this request ({exc})") from None
                case Wait():
                    await self._wait_for_slot(app.name, deadline)
                case NoMachine(why):
                    again = not looked_again and await self._look_again(app, policy, candidates, avoid, ex, not_woken)
                    looked_again = True
                    if again is True:
                        continue
                    return again or await self._last_resort(app, avoid, why)

    def _one(self, candidates: list[Candidate], policy: Policy, avoid: set[str]) -> Route | None:
        """An app of one machine (most apps), started and under its soft limit: the Route `choose` would give,
        without its regions and dicts (this is every request's path); else None."""
        if len(candidates) != 1 or self.failover.bad:
            return None
        only = candidates[0]
        if only.state != "started" or only.load >= policy.soft_limit or only.id in avoid:
            return None
        return Route(only.id)

    def _choose(self, candidates: list[Candidate], policy: Policy, prefer: str | None, avoid: set[str]) -> Decision:
        regions = {c.region for c in candidates}
        if policy.auto_create:
            regions.update(self.routes.regions())
        order = self._region_order(regions, prefer)
        bad = self.failover.avoided()
        return choose(candidates, policy, order, self.rng, avoid | bad if bad else avoid)

    async def _woken(self, app: App, machine_id: str, ex: Exchange) -> bool:
        """Start or resume a machine for this request; False if that failed (logged)."""
        waker = self.waker
        assert waker is not None
        if ex.safe and ex.head.first in AHEAD:
            waking = resume_ahead(waker, self.routes, self.pool, app, machine_id)
            if waking is not None:
                ex.waking = waking
                return True
        try:
            await waker.start(app.name, machine_id)
        except WakeError as exc:
            log.warning("proxy: %s", exc)
            return False
        return True

    def _region_order(self, regions: set[str], prefer: str | None) -> list[str]:
        """`region_order`, remembered: the same few region sets come up on every request."""
        key = (frozenset(regions), prefer)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) > 1024:
                self._orders.clear()
            order = self._orders[key] = region_order(regions, self.config.region, prefer, self.config.latency)
        return order

    async def _look_again(
        self,
        app: App,
        policy: Policy,
        candidates: list[Candidate],
        refused: set[str],
        ex: Exchange,
        not_woken: AbstractSet[str] = frozenset(),
    ) -> str | bool:
        """No machine to choose, once per request: a machine to use after all, True to choose again, or False.

        None known: the machines index may run behind (a machine created a moment ago): caught up, choose again.
        Every one refused: a machine `started` here may be stopped already (a stop a moment ago that the index had
        not shown yet when it was chosen: its worker's outbox writes it after the stop), or not listening yet. With
        auto_start it is started through its worker, the source of truth: a no-op on a machine that runs, and then
        it is given the time to listen (CI: a request right after a stop across hosts got a 502, not its autostart).
        Not one whose start failed for this request already (`not_woken`): a stop outlasting a start's wait would
        hold the request twice as long before its 502."""
        if not candidates:
            return await self.routes.caught_up(app.name)
        if not policy.auto_start:
            return False
        for machine_id in sorted(refused - not_woken):
            entry = self.routes.entry(machine_id)
            if entry is None or entry.app != app.name or entry.state not in WAKEABLE | {"started"}:
                continue
            if await self._woken(app, machine_id, ex):
                refused.discard(machine_id)
                self.failover.bad.pop(machine_id, None)
                return machine_id
        return False

    async def _started(self, machine_id: str) -> bool:
        """Wait for this proxy's start of the machine, if one is in flight; False if it failed."""
        pending = self.waker.starting.get(machine_id) if self.waker is not None else None
        if pending is None:
            return True
        try:
            await asyncio.shield(pending)
        except WakeError:
            return False
        return True

    async def _last_resort(self, app: App, avoid: set[str], why: str) -> str:
        late = await self._late_binder(app, avoid)
        if late is None:
            raise Refused(502, f"no machine of {app.name} could take this request ({why})")
        return late

    async def _late_binder(self, app: App, refused: set[str]) -> str | None:
        """Last resort, when every machine refused this request: a `started` machine may not have bound its
        port yet (a process takes a moment after its start): wait for the first such to accept."""
        for machine_id in sorted(refused):
            entry = self.routes.entry(machine_id)
            if entry is None or entry.state != "started" or not (entry.port or app.service.internal_port):
                continue
            address = self.pool.address(entry, machine_port(app, entry))
            conn = await connect_when_up(address, self.config.ready_timeout, pool=self.pool)
            if conn is None:
                return None
            self.pool.put(conn)
            self.failover.bad.pop(machine_id, None)
            refused.discard(machine_id)
            return machine_id
        return None

    async def _wait_for_slot(self, app: str, deadline: float) -> None:
        left = deadline - self.clock()
        if left <= 0 or self._queued.get(app, 0) >= self.config.max_queue:
            raise Refused(503, f"every machine of {app} is at its hard limit", retry_after=1)
        event = self._freed.get(app)
        if event is None:
            event = self._freed[app] = asyncio.Event()
        self._queued[app] = self._queued.get(app, 0) + 1
        try:
            await asyncio.wait_for(event.wait(), left)
        except TimeoutError:
            raise Refused(503, f"every machine of {app} is at its hard limit", retry_after=1) from None
        finally:
            self._queued[app] -= 1

    def release(self, machine_id: str) -> None:
        """A request (or connection) on the machine ended: count it off, stamp it used, wake a waiter."""
        left = self.loads.get(machine_id, 1) - 1
        if left:
            self.loads[machine_id] = left
        else:
            self.loads.pop(machine_id, None)
        self.last_used[machine_id] = self.clock()
        entry = self.routes.entry(machine_id)
        if entry is not None:
            event = self._freed.pop(entry.app, None)
            if event is not None:
                event.set()
