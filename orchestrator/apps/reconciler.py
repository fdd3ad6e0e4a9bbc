"""The reconciler loop: observe, plan, execute, until the app is where its release says (or fails).

Everything the CLI's app commands do is a loop of `step`s with a different stopping rule:
- `deploy`: claim a release, point the app at it, converge; if any region fails, point every
  region back at the previous good release and converge there (automatic rollback).
- `rollback`: point at an older release and converge.
- `reconcile --watch`: step every app whenever something changes (a worker's heartbeat expires, a
  machine's event, a new release), with a timer only as a backstop: the operator.
- `worker drain`: cordon the worker, then step the apps that have machines on it; the planner
  moves their machines (healthy replacement first, then the old one stops).

Wake-ups come from KV watches (workers, routing index, apps) and the events subject; the loop
debounces them. Nothing here decides what to do: `plan` does, from fresh observations each pass.
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
from nats.aio.client import Client

from bus import subjects
from bus.connection import connect
from bus.errors import NotFound
from bus.jetstream import FleetConfig, ensure_fleet_resources
from bus.messages import CordonRequest, CreateRequest, Machine, WorkerInfo
from bus.service import call
from orchestrator.apps.executor import Executor, Result
from orchestrator.apps.observe import Observer, health
from orchestrator.apps.plan import Create, Desired, Failure, Plan, plan
from orchestrator.apps.releases import Release, Releases
from orchestrator.apps.spec import SPARE, AppSpec
from orchestrator.client import FleetClient

log = logging.getLogger(__name__)

NO_ROOM_BACKOFF = 10.0  # seconds before trying again to place a spare in a region that had no room


class Converged(msgspec.Struct, kw_only=True):
    ok: bool
    plan: Plan
    failures: list[Failure] = []
    passes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        if self.ok:
            return "converged"
        return "; ".join(f"{f.region}: {f.machine_id + ' ' if f.machine_id else ''}{f.reason}" for f in self.failures)


class DeployOutcome(msgspec.Struct, kw_only=True):
    release: Release
    ok: bool
    message: str
    rolled_back_to: int | None = None
    seconds: float = 0.0


class AppLoop(msgspec.Struct, kw_only=True):
    """What one app's loop remembers between passes: clocks, not decisions."""

    unhealthy_since: dict[str, float] = {}
    no_room: dict[str, float] = {}

    def spares_blocked(self, now: float) -> frozenset[str]:
        return frozenset(region for region, at in self.no_room.items() if now - at < NO_ROOM_BACKOFF)


PlanHook = Callable[[str, Plan], None]
ResultHook = Callable[[str, Result], None]


class Reconciler:
    def __init__(
        self,
        nc: Client,
        *,
        concurrency: int = 8,
        clock: Callable[[], float] = time.time,
        poll: float = 0.25,
        backstop: float = 5.0,
    ) -> None:
        self.nc = nc
        self.clock = clock
        self.poll = poll
        self.backstop = backstop
        self.client = FleetClient(nc, timeout=15.0)
        self.executor = Executor(nc, self.client, concurrency=concurrency)
        self.observer = Observer(nc, on_change=self._on_change)
        self._wake = asyncio.Event()
        self._subs: list[Any] = []
        self._apps_watch: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.loops: dict[str, AppLoop] = {}
        self.on_plan: PlanHook | None = None
        self.on_result: ResultHook | None = None

    @classmethod
    async def connect(cls, url: str, **options: Any) -> Reconciler:
        reconciler = cls(await connect(url, "fauxmad-reconciler"), **options)
        await reconciler.start()
        return reconciler

    async def start(self) -> None:
        kv = await ensure_fleet_resources(self.nc.jetstream(), FleetConfig())
        self.releases = Releases(kv.apps, clock=self.clock)
        await self.observer.start(kv)

        async def on_event(msg: Any) -> None:
            self._wake.set()

        self._subs.append(await self.nc.subscribe(subjects.EVENTS_ALL, cb=on_event))
        self._apps_watch = await kv.apps.watchall()
        self._tasks.append(asyncio.create_task(self._follow_apps()))

    async def _follow_apps(self) -> None:
        async for _ in self._apps_watch:
            self._wake.set()

    def _on_change(self, key: str) -> None:
        self._wake.set()

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._apps_watch is not None:
            with contextlib.suppress(Exception):
                await self._apps_watch.stop()
        for task in self._tasks:
            task.cancel()
        await self.observer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.close(), 2.0)

    async def wait_for_change(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        await asyncio.sleep(0.02)  # debounce: let a burst of events land before the next look
        self._wake.clear()

    # ------------------------------------------------------------------------------------------
    async def desired(self, app: str) -> Desired | None:
        head = await self.releases.head(app)
        if head is None:
            return None
        if head.destroyed or head.version == 0:
            return Desired(app=app, release=0, spec=None)
        release = await self.releases.get(app, head.version)
        return Desired(app=app, release=release.version, spec=release.spec)

    async def step(self, desired: Desired) -> tuple[Plan, list[Result]]:
        """One pass: observe, plan, execute. Returns the plan and what became of its actions."""
        app = desired.app
        loop = self.loops.setdefault(app, AppLoop())
        now = self.clock()
        regions = list(desired.spec.regions) if desired.spec else []
        observed = await self.observer.observe(
            app, regions, unhealthy_since=loop.unhealthy_since, no_room_for_spares=loop.spares_blocked(now)
        )
        result = plan(desired, observed, now)
        loop.unhealthy_since = {i: loop.unhealthy_since.get(i, now) for i in result.unready}
        if self.on_plan is not None:
            self.on_plan(app, result)
        hook = self.on_result
        results = await self.executor.apply(app, result.actions, (lambda r: hook(app, r)) if hook is not None else None)
        for r in results:
            if isinstance(r.action, Create) and r.action.role == SPARE and r.no_room:
                loop.no_room[r.action.region] = now
        return result, results

    async def converge(
        self,
        desired: Desired,
        *,
        timeout: float,
        until: Literal["primaries", "all"] = "primaries",
        stop: asyncio.Event | None = None,
    ) -> Converged:
        """Step until the primaries are in place (or everything, with `until="all"`), a failure, or `timeout`."""
        started = time.perf_counter()
        passes = 0
        last = Plan()
        while True:
            passes += 1
            try:
                last, results = await self.step(desired)
            except Exception as exc:  # a worker that did not answer: look again
                log.info("converge: pass failed (%s); trying again", exc)
                await self.wait_for_change(self.poll)
                if time.perf_counter() - started > timeout:
                    return self._timed_out(last, passes, started)
                continue
            failures = list(last.failures) + self._capacity_failures(results)
            elapsed = time.perf_counter() - started
            if failures:
                return Converged(ok=False, plan=last, failures=failures, passes=passes, seconds=elapsed)
            done = last.converged if until == "all" else last.primaries_done
            if done:
                return Converged(ok=True, plan=last, passes=passes, seconds=elapsed)
            if elapsed > timeout:
                return self._timed_out(last, passes, started)
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

    @staticmethod
    def _capacity_failures(results: list[Result]) -> list[Failure]:
        """A primary the fleet could not place fails its region at once (fill or fail, never queue)."""
        return [
            Failure(region=r.action.region, machine_id="", reason=r.error)
            for r in results
            if isinstance(r.action, Create) and r.action.role != SPARE and not r.ok and r.no_room
        ]

    @staticmethod
    def _timed_out(last: Plan, passes: int, started: float) -> Converged:
        waiting = "; ".join(last.waiting) or "no progress"
        return Converged(
            ok=False,
            plan=last,
            passes=passes,
            seconds=time.perf_counter() - started,
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

    # ------------------------------------------------------------------------------------------
    async def deploy(self, spec: AppSpec, description: str = "deploy") -> DeployOutcome:
        started = time.perf_counter()
        before = await self.releases.current(spec.app)
        release = await self.releases.create(spec, description)
        await self.releases.point(spec.app, release.version)
        result = await self.converge(
            Desired(app=spec.app, release=release.version, spec=spec), timeout=self.timeout_for(spec)
        )
        if result.ok:
            release = await self.releases.set_status(spec.app, release.version, "complete")
            return DeployOutcome(
                release=release, ok=True, message=f"v{release.version} deployed", seconds=time.perf_counter() - started
            )
        why = result.describe()
        await self.releases.set_status(spec.app, release.version, "failed", why)
        target = (
            before
            if before is not None and before.status == "complete"
            else await self.releases.previous_good(spec.app, release.version)
        )
        if target is None:
            return DeployOutcome(
                release=release,
                ok=False,
                seconds=time.perf_counter() - started,
                message=f"v{release.version} failed: {why}; no earlier good release to roll back to",
            )
        back = await self.rollback(spec.app, target.version, reason=f"automatic rollback: v{release.version} failed")
        regions = ", ".join(sorted(target.spec.regions))
        if back.ok:
            message = f"v{release.version} failed: {why}; rolled back to v{target.version} in every region ({regions})"
        else:
            message = f"v{release.version} failed: {why}; rollback to v{target.version} failed too: {back.message}"
        return DeployOutcome(
            release=await self.releases.get(spec.app, release.version),
            ok=False,
            message=message,
            rolled_back_to=target.version if back.ok else None,
            seconds=time.perf_counter() - started,
        )

    async def rollback(self, app: str, version: int | None = None, reason: str = "rollback") -> DeployOutcome:
        """Point `app` at release `version` (default: the last good one before the current) and converge."""
        started = time.perf_counter()
        head = await self.releases.head(app)
        if head is None:
            raise NotFound(f"app {app} has no releases")
        if version is None:
            target = await self.releases.previous_good(app, head.version)
            if target is None:
                raise NotFound(f"app {app} has no good release before v{head.version} to roll back to")
        else:
            target = await self.releases.get(app, version)
        await self.releases.point(app, target.version)
        result = await self.converge(
            Desired(app=app, release=target.version, spec=target.spec), timeout=self.timeout_for(target.spec)
        )
        if head.version != target.version:
            with contextlib.suppress(NotFound):
                left = await self.releases.get(app, head.version)
                if left.status != "failed" or result.ok:
                    await self.releases.set_status(
                        app, head.version, "rolled_back", f"{reason}: back to v{target.version}"
                    )
        if result.ok:
            target = await self.releases.set_status(app, target.version, "complete")
        return DeployOutcome(
            release=target,
            ok=result.ok,
            seconds=time.perf_counter() - started,
            message=f"v{target.version} is current" if result.ok else result.describe(),
        )

    async def reconcile_once(self, app: str, timeout: float = 120.0) -> Converged:
        """Finish whatever the app's current release still needs (a deploy that was killed, a lost host)."""
        desired = await self.desired(app)
        if desired is None:
            raise NotFound(f"app {app} has no releases: deploy it first")
        limit = self.timeout_for(desired.spec) if desired.spec else timeout
        result = await self.converge(desired, timeout=limit, until="primaries")
        if result.ok and desired.spec is not None:
            current = await self.releases.get(app, desired.release)
            if current.status in ("running", "failed"):
                await self.releases.set_status(app, desired.release, "complete")
        return result

    async def watch(self, apps: list[str] | None, stop: asyncio.Event) -> None:
        """The operator: step every app whenever anything changes, until `stop` is set."""
        while not stop.is_set():
            busy = False
            for app in apps if apps is not None else await self.releases.apps():
                try:
                    desired = await self.desired(app)
                    if desired is None:
                        continue
                    result, _ = await self.step(desired)
                    busy = busy or bool(result.actions or result.waiting)
                except Exception as exc:
                    log.info("reconcile %s: %s (will look again)", app, exc)
                    busy = True
            waiter = asyncio.create_task(self.wait_for_change(self.poll if busy else self.backstop))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in (waiter, stopper):
                task.cancel()

    # ------------------------------------------------------------------------------------------
    async def destroy_app(self, app: str, timeout: float = 120.0) -> Converged:
        if await self.releases.head(app) is None and not self.observer.index.by_app(app):
            raise NotFound(f"app {app} not found")
        await self.releases.point(app, 0, destroyed=True)
        result = await self.converge(Desired(app=app, release=0, spec=None), timeout=timeout, until="all")
        if result.ok:
            await self.releases.purge(app)
        return result

    async def drain(
        self, worker_id: str, *, timeout: float = 300.0, progress: Callable[[str], None] = lambda line: None
    ) -> int:
        """Cordon `worker_id` and move its machines to other workers of its region; returns how many moved."""
        info = await call(
            self.nc, subjects.worker_cordon(worker_id, True), CordonRequest(reason="drain"), WorkerInfo, timeout=5
        )
        progress(f"cordoned {worker_id} ({info.region}): it takes no new machines")
        deadline = time.perf_counter() + timeout
        while worker_id not in self.observer.cordoned() and time.perf_counter() < deadline:
            await self.wait_for_change(0.1)  # the planner must see the cordon before it plans the move
        moved: set[str] = set()
        while True:
            machines = [m for m in await self.observer.machines_on(worker_id, None) if m.state != "destroyed"]
            if not machines:
                return len(moved)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{len(machines)} machine(s) still on {worker_id} after {timeout:.0f}s")
            for app in sorted({m.app for m in machines}):
                desired = await self.desired(app)
                if desired is not None and desired.spec is not None:
                    await self.step(desired)
                else:
                    for m in machines:
                        if m.app == app and m.id not in moved:
                            await self.move_unmanaged(m, progress)
                moved |= {m.id for m in machines if m.app == app}
            await self.wait_for_change(self.poll)

    async def move_unmanaged(self, machine: Machine, progress: Callable[[str], None]) -> None:
        """A machine no release manages: a copy elsewhere in its region (healthy first), then the old one goes."""
        running = machine.state in ("started", "starting")
        copy = await self.client.create(
            machine.app,
            CreateRequest(
                region=machine.region, config=machine.config, skip_launch=not running, avoid_workers=[machine.worker_id]
            ),
        )
        if running:
            deadline = time.perf_counter() + 60
            while time.perf_counter() < deadline:
                healthy, _ = health(await self.client.get(machine.app, copy.id))
                if healthy:
                    break
                await asyncio.sleep(0.1)
        progress(f"moved {machine.app}/{machine.id} to {copy.worker_id} as {copy.id}")
        with contextlib.suppress(NotFound):
            await self.client.destroy(machine.app, machine.id, force=True)
