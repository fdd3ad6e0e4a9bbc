"""The reconciler's core: one pass (observe, plan, execute), and passes until the app is where a desired state says.

`step` is one pass; `converge` steps until the primaries (or everything) are in place, a failure, or a timeout.
What to converge onto, and what to do when it fails, is policy, each in a module of its own, all loops of
`step`s with a different stopping rule:
- `rollout`: deploy (a preview first, then a release, converged; on failure, back to the last good release),
  rollback and reconcile once.
- `watch`: the operator, stepping every app whenever something changes.
- `drain`: cordon a worker, then step the apps that have machines on it.
- `destroy`: point an app at nothing and converge until no machine is left.

Wake-ups come from KV watches (workers, routing index, apps) and the events subject (see `follow`); the loop
debounces them. Nothing here decides what to do: `plan` does, from fresh observations each pass.

The loop is built from its ports (`Bus`, `MachinesApi`, `ReleaseStore`, two `Clock`s; see `ports`):
`connect` wires them to NATS and follows the fleet's KV and events; a unit test builds one over an
in-memory fleet, with a clock it moves by hand and no poll, so nothing in it waits for real time.

Its connection is an agent's once made (`bus.transport.connection`, `reconnect_forever`): a nats-server
restart is a blip, as it is for the workers and brokers. With a command's settings (three tries a tenth of a
second apart) an outage of a second closed it for good and the operator stayed alive but deaf, every pass
failing with `ConnectionClosedError`. A connection that does close for good (a server `-ERR`) is `lost`:
`check_connected` raises it, and the operator and `converge` stop with that one line instead of looping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from bus.contract.errors import BadRequest, NoCapacity, Unreachable
from bus.transport.connection import connect, role_of
from bus.transport.jetstream import FleetConfig, ensure_fleet_resources
from orchestrator.apps.releases import Head, Release, Releases, WatchedReleases
from orchestrator.apps.spec import SPARE, AppSpec
from orchestrator.apps.store import KVReleaseStore
from orchestrator.client import PROGRESS_CAP, FleetClient
from orchestrator.reconcile.actions import Create, Desired, Failure, Plan, Update
from orchestrator.reconcile.executor import Executor, Result
from orchestrator.reconcile.follow import Following
from orchestrator.reconcile.observe import Observer
from orchestrator.reconcile.over_nats import NatsBus
from orchestrator.reconcile.plan import plan, summarize
from orchestrator.reconcile.ports import Bus, Clock, MachinesApi, ReleaseStore
from orchestrator.reconcile.routes import Route, for_role, to_workers
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)

NO_ROOM_BACKOFF = 10.0  # seconds before trying again to place a spare in a region that had no room


class Converged(msgspec.Struct, kw_only=True):
    ok: bool
    plan: Plan
    failures: list[Failure] = []
    passes: int = 0
    seconds: float = 0.0
    first: Plan | None = None  # the first pass's plan: nothing in it, nothing was left to do

    def errors(self) -> list[str]:
        """One line per distinct error (sixteen machines failing alike are one line)."""
        return summarize(self.failures)

    def describe(self) -> str:
        return "converged" if self.ok else "; ".join(self.errors())


class AppLoop(msgspec.Struct, kw_only=True):
    """What one app's loop remembers between passes: clocks, not decisions."""

    unhealthy_since: dict[str, float] = {}
    # the states each unready machine has been seen in while its clock ran: a state not seen before is progress
    # (the worker is working: replacing, starting, started), and starts its clock again; a crash loop's states
    # come round again and do not (docs/explanation/faults.md, "Deadlines that follow progress")
    unready_states: dict[str, frozenset[str]] = {}
    no_room: dict[str, float] = {}
    seen: set[tuple[str, str, bool, float]] = set()  # every (machine, state, healthy, instance) observed
    moved_at: float = 0.0  # the timer when `seen` last grew: the app's machines last made progress

    def spares_blocked(self, now: float) -> frozenset[str]:
        return frozenset(region for region, at in self.no_room.items() if now - at < NO_ROOM_BACKOFF)


PlanHook = Callable[[str, Plan], None]
ResultHook = Callable[[str, Result], None]


def desired_from(app: str, head: Head | None, release: Release | None) -> Desired | None:
    """What `app` should run, from its head and the release the head names: None without a head (or, from the
    apps watch, while that release has not arrived), release 0 while the app is being destroyed."""
    if head is None:
        return None
    if head.destroyed or head.version == 0:
        return Desired(app=app, release=0, spec=None)
    return Desired(app=app, release=release.version, spec=release.spec) if release is not None else None


class Reconciler:
    def __init__(
        self,
        bus: Bus,
        machines: MachinesApi,
        store: ReleaseStore,
        *,
        concurrency: int = 8,
        clock: Clock = time.time,
        timer: Clock = time.perf_counter,
        poll: float = 0.25,
        backstop: float = 5.0,
        debounce: float = 0.02,
        region: str | None = None,
        route: Route = to_workers,
    ) -> None:
        self.bus = bus
        # an operator of one region (a supercluster runs one per region): it plans and acts on that region's
        # machines only, so a region cut off from the others is failed over by its own operator and by nobody else
        self.region = region
        self.watched = WatchedReleases()  # what the apps watch showed: the fallback while the bucket does not answer
        self.machines = machines
        self.clock = clock  # when things happen: releases, health deadlines, the planner's `now`
        self.timer = timer  # how long a loop has run: deploy timeouts, drain deadlines
        self.poll = poll
        self.backstop = backstop
        self.debounce = debounce
        self.releases = Releases(store, clock=clock)
        # to the workers, or (an identity that may not speak to them: a deployer) through the brokers (`routes`)
        self.route = route
        self.observer = Observer(bus, registry=Registry(clock=clock), on_change=self._on_change, route=route)
        self.executor = Executor(bus, machines, concurrency=concurrency, route=route, lost=self.observer.lost)
        self.following: Following | None = None
        self._wake = asyncio.Event()
        self.loops: dict[str, AppLoop] = {}
        self.on_plan: PlanHook | None = None
        self.on_result: ResultHook | None = None
        self.lost: str | None = None  # why the connection closed for good, if it did
        self._closing = False

    @classmethod
    async def connect(cls, url: str, **options: Any) -> Reconciler:
        """A reconciler over NATS at `url`, following the fleet (its replicas current, woken by changes).

        Fails fast when NATS is not there; once connected it reconnects forever (see the module docstring)."""
        reconciler: Reconciler | None = None

        def on_closed(reason: str) -> None:
            if reconciler is not None:  # (closed before it exists: `check_connected` finds the connection closed)
                reconciler.bus_closed(reason)

        nc = await connect(url, "fauxmad-reconciler", reconnect_forever=True, on_closed=on_closed)
        kv = await ensure_fleet_resources(nc.jetstream(), FleetConfig(region=options.get("region")))
        route = options.pop("route", None) or for_role(role_of(nc))
        reconciler = cls(NatsBus(nc), FleetClient(nc, timeout=15.0), KVReleaseStore(kv.apps), route=route, **options)
        reconciler.following = await Following.start(
            nc,
            kv,
            reconciler.observer,
            reconciler.watched,
            reconciler.wake,
            fleet_wide=route is to_workers,  # another identity may subscribe to its inbox only: it polls
        )
        return reconciler

    def bus_closed(self, reason: str) -> None:
        """The connection is gone for good (not a reconnect): never stay alive but deaf. Ignored while closing."""
        if self._closing or self.lost is not None:
            return
        self.lost = reason
        log.info("reconciler: %s", reason)  # said once, by whoever stops on `check_connected`
        self.wake()  # a loop waiting for a change looks, and stops

    def check_connected(self) -> None:
        """Raise `Unreachable` if the connection closed for good: nothing this reconciler does can work again.

        It asks the connection too: nats-py skips the closed callback when closing fails halfway (it writes
        what is pending to the dead socket first, which raises under uvloop), and a loop must not rely on it."""
        if self.lost is None and self.following is not None:
            closed = self.following.closed_for_good()
            if closed is not None:
                self.bus_closed(closed)
        if self.lost is not None:
            raise Unreachable(f"the reconciler lost NATS for good ({self.lost}); its supervisor should restart it")

    def _on_change(self, key: str) -> None:
        self.wake()

    def wake(self) -> None:
        """Something changed: the loop looks again (after the debounce)."""
        self._wake.set()

    async def close(self) -> None:
        self._closing = True
        if self.following is not None:
            await self.following.close()
        else:
            await self.observer.close()

    def jetstream(self) -> Any:
        """The JetStream context of this reconciler's connection (a deploy pushes and resolves images on it)."""
        assert self.following is not None, "not connected: use Reconciler.connect"
        return self.following.jetstream()

    async def wait_for_change(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        await asyncio.sleep(self.debounce)  # let a burst of events land before the next look
        self._wake.clear()

    # ------------------------------------------------------------------------------------------
    async def desired(self, app: str) -> Desired | None:
        head = await self.releases.head(app)
        if head is None or head.destroyed or head.version == 0:
            return desired_from(app, head, None)  # no release to read
        return desired_from(app, head, await self.releases.get(app, head.version))

    async def step(self, desired: Desired, exits_since: float | None = None) -> tuple[Plan, list[Result]]:
        """One pass: observe, plan, execute. Returns the plan and what became of its actions.

        With `exits_since` (a deploy's start), a primary of the release whose process ended on its own
        since then fails the pass at once."""
        app = desired.app
        loop = self.loops.setdefault(app, AppLoop())
        now = self.clock()
        if self.region is not None and desired.spec is not None:  # this region's count only
            if self.region not in desired.spec.regions:
                # the app runs elsewhere: nothing here is this operator's, as a region no spec names is nobody's
                # (a spec with no region is not a spec: making one failed every pass, and the operator, taking the
                # failure for a busy app, looked again at its fastest poll for as long as the app existed)
                return Plan(), []
            counts = {self.region: desired.spec.regions[self.region]}
            desired = msgspec.structs.replace(desired, spec=msgspec.structs.replace(desired.spec, regions=counts))
        regions = list(desired.spec.regions) if desired.spec else []
        observed = await self.observer.observe(
            app,
            regions,
            unhealthy_since=loop.unhealthy_since,
            no_room_for_spares=loop.spares_blocked(now),
            exits_since=exits_since,
            only_region=self.region,
        )
        states = {m.id: m.state for m in observed.machines}
        since = {
            i: at if states.get(i) in loop.unready_states.get(i, frozenset()) else now
            for i, at in loop.unhealthy_since.items()
        }
        observed = msgspec.structs.replace(observed, unhealthy_since=since)
        marks = {(m.id, m.state, m.healthy, m.instance_at) for m in observed.machines}
        if not marks <= loop.seen:
            loop.moved_at = self.timer()
        loop.seen = {mark for mark in loop.seen if mark[0] in states} | marks  # destroyed machines forgotten
        result = plan(desired, observed, now)
        loop.unhealthy_since = {i: since.get(i, now) for i in result.unready}
        loop.unready_states = {i: loop.unready_states.get(i, frozenset()) | {states.get(i, "")} for i in result.unready}
        if self.on_plan is not None:
            self.on_plan(app, result)
        results = await self.executor.apply(app, result.actions, self.result_hook(app))
        for r in results:
            if isinstance(r.action, Create) and r.action.role == SPARE and r.no_room:
                loop.no_room[r.action.region] = now
        return result, results

    def result_hook(self, app: str) -> Callable[[Result], None] | None:
        hook = self.on_result
        return (lambda r: hook(app, r)) if hook is not None else None

    async def converge(
        self,
        desired: Desired,
        *,
        timeout: float,
        until: Literal["primaries", "all"] = "primaries",
        stop: asyncio.Event | None = None,
        exits_since: float | None = None,
    ) -> Converged:
        """Step until the primaries are in place (or everything, with `until="all"`), a failure, or `timeout`
        seconds without progress: the clock starts again whenever the app's machines reach a state not seen
        before in this wait (the workers are working), up to PROGRESS_CAP times `timeout` in all."""
        started = self.timer()
        loop = self.loops.setdefault(desired.app, AppLoop())
        loop.moved_at, loop.seen = started, set()
        passes = 0
        last = Plan()
        first: Plan | None = None
        while True:
            passes += 1
            try:
                last, results = await self.step(desired, exits_since)
            except Exception as exc:  # a worker that did not answer: look again
                self.check_connected()  # unless nothing can answer any more
                log.info("converge: pass failed (%s); trying again", exc)
                await self.wait_for_change(self.poll)
                if self._out_of_time(desired.app, started, timeout):
                    return self._timed_out(last, passes, started, timeout)
                continue
            first = first or last
            failures = list(last.failures) + self._refused(results)
            elapsed = self.timer() - started
            if failures:
                return Converged(ok=False, plan=last, failures=failures, passes=passes, seconds=elapsed, first=first)
            done = last.converged if until == "all" else last.primaries_done
            if done:
                return Converged(ok=True, plan=last, passes=passes, seconds=elapsed, first=first)
            if self._out_of_time(desired.app, started, timeout):
                return self._timed_out(last, passes, started, timeout)
            if stop is not None and stop.is_set():
                return Converged(
                    ok=False,
                    plan=last,
                    passes=passes,
                    seconds=elapsed,
                    failures=[Failure(region="*", machine_id="", reason="interrupted")],
                )
            if not last.actions:
                await self.wait_for_change(self.poll)

    def _out_of_time(self, app: str, started: float, timeout: float) -> bool:
        """`timeout` seconds since the app's machines last made progress, or PROGRESS_CAP times it in all."""
        now = self.timer()
        moved = self.loops[app].moved_at if app in self.loops else started
        return now - max(started, moved) > timeout or now - started > PROGRESS_CAP * timeout

    @staticmethod
    def _refused(results: list[Result]) -> list[Failure]:
        """A primary the fleet could not place (`NoCapacity`: fill or fail, never queue) or a create or update a
        worker refused as invalid (`BadRequest`: asking again gets the same answer) fails its region at once.
        Anything else (a lease held by another reconciler, a timeout) is left to the next pass."""
        out = []
        for r in results:
            action = r.action
            if r.ok or not r.failed_with(BadRequest, NoCapacity) or not isinstance(action, Create | Update):
                continue
            if isinstance(action, Create) and action.role == SPARE and r.no_room:
                continue  # a spare without room is retried later; it never fails a deploy
            what = "placing a new machine" if isinstance(action, Create) else "updating"
            out.append(Failure(region=action.region, machine_id=r.machine_id, reason=f"{what} failed", detail=r.error))
        return out

    def _timed_out(self, last: Plan, passes: int, started: float, timeout: float) -> Converged:
        waiting = "; ".join(last.waiting) or f"no progress for {timeout:g}s"
        return Converged(
            ok=False,
            plan=last,
            passes=passes,
            seconds=self.timer() - started,
            failures=[Failure(region="*", machine_id="", reason=f"timed out waiting: {waiting}")],
        )

    @staticmethod
    def timeout_for(spec: AppSpec) -> float:
        """How long a deploy may take: enough batches of `wait_timeout` for the biggest region, plus slack."""
        biggest = max(spec.regions.values(), default=1) or 1
        batches = (
            1
            if spec.deploy.strategy in ("immediate", "bluegreen")
            else math.ceil(biggest / spec.deploy.unavailable_budget(biggest))
        )
        return spec.deploy.wait_seconds * (batches + 2) + 30.0
