"""The reconciler loop: observe, plan, execute, until the app is where its release says (or fails).

Everything the CLI's app commands do is a loop of `step`s with a different stopping rule:
- `deploy`: first a preview (the whole plan, simulated, and whether every region has live workers with
  room for it): a deploy that cannot work fails before it touches anything, and a spec the app already
  runs claims no release. Then claim a release, point the app at it, converge; if any region fails
  (a machine not healthy in time, or one whose process ends on its own: at once), point every region
  back at the previous good release and converge there; with none, remove what the deploy created.
- `rollback`: point at an older release and converge; a failed release only when forced, and if the
  rollback fails, back to the last good release.
- `reconcile --watch`: step every app whenever something changes (a worker's heartbeat expires, a
  machine's event, a new release), with a timer only as a backstop: the operator.
- `worker drain`: cordon the worker, then step the apps that have machines on it; the planner
  moves their machines (healthy replacement first, then the old one stops).

Wake-ups come from KV watches (workers, routing index, apps) and the events subject; the loop
debounces them. Nothing here decides what to do: `plan` does, from fresh observations each pass.

The loop is built from its ports (`Bus`, `MachinesApi`, `ReleaseStore`, two `Clock`s; see `ports`):
`connect` wires them to NATS and follows the fleet's KV and events; a unit test builds one over an
in-memory fleet, with a clock it moves by hand and no poll, so nothing in it waits for real time.
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

from bus.contract import subjects
from bus.contract.codec import decoder
from bus.contract.errors import BadRequest, Conflict, NoCapacity, NotFound
from bus.contract.messages import CordonRequest, CreateRequest, Machine, ProxyUnreachable, WorkerInfo
from bus.transport.connection import connect
from bus.transport.jetstream import FleetConfig, FleetKV, ensure_fleet_resources
from orchestrator.client import FleetClient
from orchestrator.reconcile.executor import Executor, Result
from orchestrator.reconcile.observe import Observer, health
from orchestrator.reconcile.over_nats import KVReleaseStore, NatsBus
from orchestrator.reconcile.plan import Create, Desired, Destroy, Failure, Plan, Update, plan, summarize
from orchestrator.reconcile.ports import Bus, Clock, MachinesApi, ReleaseStore
from orchestrator.reconcile.preview import Planned, planned, problems, simulate
from orchestrator.reconcile.releases import Head, Release, Releases, WatchedReleases
from orchestrator.reconcile.spec import SPARE, AppSpec
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)

DESIRED_TIMEOUT = 5.0  # seconds the operator waits for the desired state before using the last it read
DESIRED_RETRY = 5.0  # seconds it then uses the last one without asking
NO_ROOM_BACKOFF = 10.0  # seconds before trying again to place a spare in a region that had no room


SCALED = "scale "  # how `scale` describes the releases it makes


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


class DeployOutcome(msgspec.Struct, kw_only=True):
    release: Release  # the release deployed or rolled back to (the current one when nothing changed)
    ok: bool
    message: str
    errors: list[str] = []  # one line per distinct error
    rolled_back_to: int | None = None
    changed: bool = True  # False: the app already ran this spec, and no release was made
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """What to tell a person: the message, or one line per distinct error ending with what was done."""
        return self.message.split("\n")


class Preview(msgspec.Struct, kw_only=True):
    """What `deploy` would do now, and why it could not (`problems`), before anything is touched."""

    app: str
    release: int  # the release it would make (or the current one, when nothing changed)
    current: Release | None
    changes: bool
    actions: list[Planned]
    problems: list[str]
    warnings: list[str]


class CannotDeploy(Exception):
    """The fleet cannot take this deploy (a region without live workers or room); nothing was touched."""

    def __init__(self, app: str, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.app = app
        self.problems = problems


class AppLoop(msgspec.Struct, kw_only=True):
    """What one app's loop remembers between passes: clocks, not decisions."""

    unhealthy_since: dict[str, float] = {}
    no_room: dict[str, float] = {}

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
    ) -> None:
        self.bus = bus
        # an operator of one region (a supercluster runs one per region): it plans and acts on that region's
        # machines only, so a region cut off from the others is failed over by its own operator and by nobody else
        self.region = region
        self._last_desired: dict[str, Desired] = {}
        self._known_apps: set[str] = set()  # the last app list read
        self._watched = WatchedReleases()  # what the apps watch showed: the fallback while the bucket does not answer
        self._desired_quiet_until = 0.0
        self.machines = machines
        self.clock = clock  # when things happen: releases, health deadlines, the planner's `now`
        self.timer = timer  # how long a loop has run: deploy timeouts, drain deadlines
        self.poll = poll
        self.backstop = backstop
        self.debounce = debounce
        self.releases = Releases(store, clock=clock)
        self.executor = Executor(bus, machines, concurrency=concurrency)
        self.observer = Observer(bus, registry=Registry(clock=clock), on_change=self._on_change)
        self._nc: Client | None = None
        self._wake = asyncio.Event()
        self._subs: list[Any] = []
        self._apps_watch: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: set[str] = set()  # workers being probed after an edge proxy's signal
        self.loops: dict[str, AppLoop] = {}
        self.on_plan: PlanHook | None = None
        self.on_result: ResultHook | None = None

    @classmethod
    async def connect(cls, url: str, **options: Any) -> Reconciler:
        """A reconciler over NATS at `url`, following the fleet (its replicas current, woken by changes)."""
        nc = await connect(url, "fauxmad-reconciler")
        kv = await ensure_fleet_resources(nc.jetstream(), FleetConfig(region=options.get("region")))
        reconciler = cls(NatsBus(nc), FleetClient(nc, timeout=15.0), KVReleaseStore(kv.apps), **options)
        await reconciler._follow(nc, kv)
        return reconciler

    async def _follow(self, nc: Client, kv: FleetKV) -> None:
        """Keep the replicas current and wake the loop on any change: workers, machines, events, releases."""
        self._nc = nc
        await self.observer.start(kv)

        async def on_event(msg: Any) -> None:
            self._wake.set()

        self._subs.append(await nc.subscribe(subjects.EVENTS_ALL, cb=on_event))
        self._subs.append(await nc.subscribe(subjects.PROXY_UNREACHABLE_ALL, cb=self._on_proxy_signal))
        self._apps_watch = await kv.apps.watchall()
        self._tasks.append(asyncio.create_task(self._follow_apps()))

    async def _on_proxy_signal(self, msg: Any) -> None:
        """An edge proxy could not reach a machine: have its worker probed (in a task: callbacks run one
        at a time), at most once per worker at a time."""
        try:
            signal = decoder(ProxyUnreachable).decode(msg.data)
        except msgspec.DecodeError:
            log.info("ignoring a malformed signal on %s", msg.subject)
            return
        if signal.worker_id in self._probing:
            return
        self._probing.add(signal.worker_id)

        async def probe() -> None:
            try:
                if await self.observer.check_host(signal.worker_id, signal.app):
                    log.warning(
                        "worker %s is silent after proxy %s could not reach %s: treating its machines as lost",
                        signal.worker_id,
                        signal.proxy_region or "?",
                        signal.machine_id,
                    )
            finally:
                self._probing.discard(signal.worker_id)

        task = asyncio.create_task(probe())
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _follow_apps(self) -> None:
        async for entry in self._apps_watch:
            if entry is not None:
                self._watched.apply(entry.key, entry.value if entry.operation is None else None)
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
        for task in list(self._tasks):
            task.cancel()
        await self.observer.close()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), 2.0)

    def jetstream(self) -> Any:
        """The JetStream context of this reconciler's connection (a deploy pushes and resolves images on it)."""
        assert self._nc is not None, "not connected: use Reconciler.connect"
        return self._nc.jetstream()

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
            counts = {r: n for r, n in desired.spec.regions.items() if r == self.region}
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
        result = plan(desired, observed, now)
        loop.unhealthy_since = {i: loop.unhealthy_since.get(i, now) for i in result.unready}
        if self.on_plan is not None:
            self.on_plan(app, result)
        results = await self.executor.apply(app, result.actions, self._result_hook(app))
        for r in results:
            if isinstance(r.action, Create) and r.action.role == SPARE and r.no_room:
                loop.no_room[r.action.region] = now
        return result, results

    def _result_hook(self, app: str) -> Callable[[Result], None] | None:
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
        """Step until the primaries are in place (or everything, with `until="all"`), a failure, or `timeout`."""
        started = self.timer()
        passes = 0
        last = Plan()
        first: Plan | None = None
        while True:
            passes += 1
            try:
                last, results = await self.step(desired, exits_since)
            except Exception as exc:  # a worker that did not answer: look again
                log.info("converge: pass failed (%s); trying again", exc)
                await self.wait_for_change(self.poll)
                if self.timer() - started > timeout:
                    return self._timed_out(last, passes, started)
                continue
            first = first or last
            failures = list(last.failures) + self._refused(results)
            elapsed = self.timer() - started
            if failures:
                return Converged(ok=False, plan=last, failures=failures, passes=passes, seconds=elapsed, first=first)
            done = last.converged if until == "all" else last.primaries_done
            if done:
                return Converged(ok=True, plan=last, passes=passes, seconds=elapsed, first=first)
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
    def _refused(results: list[Result]) -> list[Failure]:
        """A primary the fleet could not place (503: fill or fail, never queue) or a create or update a worker
        refused as invalid (400: asking again gets the same answer) fails its region at once. Anything else
        (a lease held by another reconciler, a timeout) is left to the next pass."""
        out = []
        for r in results:
            action = r.action
            if r.ok or r.code not in (BadRequest.code, NoCapacity.code) or not isinstance(action, Create | Update):
                continue
            if isinstance(action, Create) and action.role == SPARE and r.code == NoCapacity.code:
                continue  # a spare without room is retried later; it never fails a deploy
            what = "placing a new machine" if isinstance(action, Create) else "updating"
            out.append(Failure(region=action.region, machine_id=r.machine_id, reason=f"{what} failed", detail=r.error))
        return out

    def _timed_out(self, last: Plan, passes: int, started: float) -> Converged:
        waiting = "; ".join(last.waiting) or "no progress"
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

    # ------------------------------------------------------------------------------------------
    async def preview(self, spec: AppSpec) -> Preview:
        """The whole deploy of `spec`, simulated on the fleet as it is, and what stands in its way."""
        current = await self.releases.current(spec.app)
        changes = current is None or current.spec != spec or current.status not in ("complete", "running")
        version = await self.releases.next_version(spec.app) if changes or current is None else current.version
        observed = await self.observer.observe(spec.app, list(spec.regions))
        desired = Desired(app=spec.app, release=version, spec=spec)
        now = self.clock()
        return Preview(
            app=spec.app,
            release=version,
            current=current,
            changes=changes,
            actions=planned(desired, observed, now),
            problems=problems(spec, simulate(desired, observed, now), self.observer.registry.workers()),
            warnings=self._scale_warnings(spec, current),
        )

    @staticmethod
    def _scale_warnings(spec: AppSpec, current: Release | None) -> list[str]:
        if current is None or not current.description.startswith(SCALED) or current.spec.regions == spec.regions:
            return []
        regions = sorted(set(current.spec.regions) | set(spec.regions))
        changes = ", ".join(
            f"{r} {current.spec.regions.get(r, 0)} -> {spec.regions.get(r, 0)}"
            for r in regions
            if current.spec.regions.get(r, 0) != spec.regions.get(r, 0)
        )
        return [
            f"this deploy changes the machine counts `fauxmad scale` set in v{current.version} ({changes}); "
            "put them in the spec's [regions] to keep them"
        ]

    async def deploy(
        self, spec: AppSpec, description: str = "deploy", *, checked: Preview | None = None, always: bool = False
    ) -> DeployOutcome:
        """Deploy `spec`: refuse what cannot work (`CannotDeploy`, nothing touched), converge the current
        release when the app already runs this spec (unless `always`: `scale` makes its release anyway,
        a relabel in place), else a new release (see `finish`)."""
        started = self.timer()
        seen = checked or await self.preview(spec)
        if seen.problems:
            raise CannotDeploy(spec.app, seen.problems)
        if not seen.changes and seen.current is not None and not always:
            return await self._again(seen.current, started)
        release = await self.begin(spec, description)
        outcome = await self.finish(release)
        outcome.seconds = self.timer() - started
        return outcome

    async def begin(self, spec: AppSpec, description: str = "deploy") -> Release:
        """Claim a release for `spec` and point the app at it; `finish` converges it."""
        head = await self.releases.head(spec.app)
        previous = head.version if head is not None and head.version else None
        release = await self.releases.create(spec, description, previous)
        await self.releases.point(spec.app, release.version)
        return release

    async def _again(self, current: Release, started: float) -> DeployOutcome:
        """The app already runs this spec: no release, only whatever the current one still needs."""
        app, version = current.app, current.version
        result = await self.converge(
            Desired(app=app, release=version, spec=current.spec),
            timeout=self.timeout_for(current.spec),
            exits_since=self.clock(),
        )
        if result.ok and current.status == "running":
            current = await self.releases.set_status(app, version, "complete")
        idle = result.ok and result.first is not None and not result.first.actions and not result.first.waiting
        if idle:
            message = f"already at v{version}: nothing to change"
        elif result.ok:
            message = f"v{version} was already current; its machines are in place again"
        else:
            message = "\n".join(f"v{version}: {line}" for line in result.errors())
        return DeployOutcome(
            release=current,
            ok=result.ok,
            changed=False,
            message=message,
            errors=[] if result.ok else result.errors(),
            seconds=self.timer() - started,
        )

    async def finish(self, release: Release) -> DeployOutcome:
        """Converge the app onto `release` (already current); if it fails, go back to the last good release
        in every region, or, with none, remove the machines it created and leave the app with no current
        release. The failed release keeps status `failed` and its reason."""
        started = self.timer()
        app, version, spec = release.app, release.version, release.spec
        result = await self.converge(
            Desired(app=app, release=version, spec=spec), timeout=self.timeout_for(spec), exits_since=self.clock()
        )
        if result.ok:
            release = await self.releases.set_status(app, version, "complete")
            return DeployOutcome(
                release=release, ok=True, message=f"v{version} deployed", seconds=self.timer() - started
            )
        errors = result.errors()
        await self.releases.set_status(app, version, "failed", "; ".join(errors))
        target = await self._back_from(release)
        rolled_back_to = None
        if target is None:
            removed = await self._remove(release)
            after = f"removed the {removed} machine(s) it created (no earlier good release to roll back to)"
        else:
            back = await self._converge_to(target)
            regions = ", ".join(sorted(target.spec.regions))
            if back.ok:
                rolled_back_to = target.version
                after = f"rolled back to v{target.version} in every region ({regions})"
            else:
                after = f"rollback to v{target.version} failed too: {back.describe()}"
        lines = [f"v{version} failed: {line}" for line in errors]
        lines[-1] += f"; {after}"
        return DeployOutcome(
            release=await self.releases.get(app, version),
            ok=False,
            message="\n".join(lines),
            errors=errors,
            rolled_back_to=rolled_back_to,
            seconds=self.timer() - started,
        )

    async def _back_from(self, release: Release) -> Release | None:
        """Where a failed deploy goes back to: the release the app ran before it, if that one was good, else
        the newest good release before it."""
        if release.previous:
            with contextlib.suppress(NotFound):
                before = await self.releases.get(release.app, release.previous)
                if before.status == "complete":
                    return before
        return await self.releases.previous_good(release.app, release.version)

    async def _converge_to(self, target: Release) -> Converged:
        """Point the app at `target` and converge; a good release converged onto is complete again."""
        await self.releases.point(target.app, target.version)
        result = await self.converge(
            Desired(app=target.app, release=target.version, spec=target.spec),
            timeout=self.timeout_for(target.spec),
            exits_since=self.clock(),
        )
        if result.ok:
            await self.releases.set_status(target.app, target.version, "complete")  # a failed one stays failed
        return result

    async def _remove(self, release: Release) -> int:
        """Destroy the machines labelled with `release` and forget the app's current release, as it was
        before this deploy (machines of the app that no release made are left alone)."""
        app, label = release.app, str(release.version)
        removed = 0
        for _ in range(5):
            observed = await self.observer.observe(app, list(release.spec.regions))
            mine = [m for m in observed.machines if m.release == label]
            if not mine:
                break
            actions = tuple(
                Destroy(id=m.id, region=m.region, worker_id=m.worker_id, reason=f"v{label} failed: removing it")
                for m in mine
            )
            results = await self.executor.apply(app, actions, self._result_hook(app))
            removed += sum(r.ok for r in results)
        head = await self.releases.head(app)
        if head is not None and head.version == release.version:
            await self.releases.forget_head(app)
        return removed

    async def rollback_target(self, app: str, version: int | None, *, force: bool = False) -> tuple[Head, Release]:
        """Where a rollback of `app` goes, and the head it leaves; raises if there is none, or (without
        `force`) if that release's deploy failed."""
        head = await self.releases.head(app)
        if head is None:
            if not await self.releases.list(app):
                raise NotFound(f"app {app} has no releases")
            head = Head(app=app, version=0)
        if version is None:
            target = await self.releases.previous_good(app, head.version or 1 << 62)
            if target is None:
                raise NotFound(f"app {app} has no good release before v{head.version} to roll back to")
        else:
            target = await self.releases.get(app, version)
        if target.status == "failed" and not force:
            why = target.reason if len(target.reason) <= 160 else target.reason[:159] + "…"
            raise Conflict(f"v{target.version} failed ({why}): pass --force to roll back to it anyway")
        return head, target

    async def rollback(
        self, app: str, version: int | None = None, reason: str = "rollback", *, force: bool = False
    ) -> DeployOutcome:
        """Point `app` at release `version` (default: the last good one before the current) and converge.

        A failed release is refused unless `force`. If the rollback fails, the app goes back to the release
        it ran before (or the newest good one), and the command says so; no release is relabelled but the
        one rolled back from, and only when the rollback worked (a failed release never is)."""
        started = self.timer()
        head, target = await self.rollback_target(app, version, force=force)
        before = await self.releases.get(app, head.version) if head.version else None
        result = await self._converge_to(target)
        if result.ok:
            if before is not None and before.version != target.version:
                note = f"{reason}: back to v{target.version}"
                await self.releases.set_status(app, before.version, "rolled_back", note)
            return DeployOutcome(
                release=await self.releases.get(app, target.version),
                ok=True,
                seconds=self.timer() - started,
                message=f"v{target.version} is current",
            )
        errors = result.errors()
        stays = before is not None and before.status == "complete" and before.version != target.version
        good = before if stays else await self.releases.last_good(app, besides=target.version)
        if good is None:
            after = "no good release to go back to"
        else:
            back = await self._converge_to(good)
            after = f"back on v{good.version}"
            if not back.ok:
                after = f"going back to v{good.version} failed too: {back.describe()}"
        lines = [f"rollback to v{target.version} failed: {line}" for line in errors]
        lines[-1] += f"; {after}"
        return DeployOutcome(
            release=target,
            ok=False,
            errors=errors,
            seconds=self.timer() - started,
            message="\n".join(lines),
        )

    async def reconcile_once(self, app: str, timeout: float = 120.0) -> Converged:
        """Finish whatever the app's current release still needs (a deploy that was killed, a lost host)."""
        desired = await self.desired(app)
        if desired is None:
            raise NotFound(f"app {app} has no releases: deploy it first")
        limit = self.timeout_for(desired.spec) if desired.spec else timeout
        result = await self.converge(desired, timeout=limit, until="primaries", exits_since=self.clock())
        if result.ok and desired.spec is not None:
            current = await self.releases.get(app, desired.release)
            if current.status == "running":  # a deploy that was killed halfway, finished now
                await self.releases.set_status(app, desired.release, "complete")
        return result

    async def watch(self, apps: list[str] | None, stop: asyncio.Event) -> None:
        """The operator: step every app whenever anything changes, until `stop` is set."""
        while not stop.is_set():
            busy = False
            for app in apps if apps is not None else await self._apps():
                try:
                    desired = await self._desired_or_last(app)
                    if desired is None:
                        continue
                    result, _ = await self.step(desired)
                    busy = busy or bool(result.actions or result.waiting)
                except Exception as exc:
                    log.warning("reconcile %s: %s (will look again)", app, exc)
                    busy = True
            waiter = asyncio.create_task(self.wait_for_change(self.poll if busy else self.backstop))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in (waiter, stopper):
                task.cancel()

    async def _apps(self) -> list[str]:
        """The apps with releases; while the desired state does not answer (a supercluster's region cut off from
        the home region, which keeps it), the last list seen and the apps the apps watch brought since."""
        if self.timer() >= self._desired_quiet_until:
            try:
                self._known_apps = set(await asyncio.wait_for(self.releases.apps(), DESIRED_TIMEOUT))
                return sorted(self._known_apps)
            except Exception as exc:
                self._desired_quiet_until = self.timer() + DESIRED_RETRY
                log.warning("the app list did not answer (%r): using the last one seen", exc)
        return sorted(self._known_apps | self._watched.apps())

    async def _desired_or_last(self, app: str) -> Desired | None:
        """`desired(app)`, or the last one read while the desired state does not answer: a region cut off from
        the home region keeps converging to the release it last saw (it cannot see a newer one anyway). After a
        read that did not answer, the last one is used at once for `DESIRED_RETRY` seconds: a pass is not held
        up by a timeout each time. The apps watch's view goes before the last read: it is at least as new, and an
        operator whose reads failed from its start (its JetStream still electing when the cut began) has no other."""
        last = self._watched_desired(app) or self._last_desired.get(app)
        if last is not None and self.timer() < self._desired_quiet_until:
            return last
        try:
            desired = await asyncio.wait_for(self.desired(app), DESIRED_TIMEOUT)
        except Exception as exc:
            self._desired_quiet_until = self.timer() + DESIRED_RETRY
            if last is None:
                raise
            log.info("the desired state of %s did not answer (%r): converging to release %d", app, exc, last.release)
            return last
        if desired is not None:
            self._last_desired[app] = desired
        return desired

    def _watched_desired(self, app: str) -> Desired | None:
        head = self._watched.head(app)
        return desired_from(app, head, self._watched.release(app, head.version) if head is not None else None)

    # ------------------------------------------------------------------------------------------
    async def destroy_app(self, app: str, timeout: float = 120.0) -> Converged:
        if (
            await self.releases.head(app) is None
            and not self.observer.index.by_app(app)
            and not await self.releases.list(app)
        ):
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
        info = await self.bus.call(
            subjects.worker_cordon(worker_id, True), CordonRequest(reason="drain"), WorkerInfo, timeout=5
        )
        progress(f"cordoned {worker_id} ({info.region}): it takes no new machines")
        deadline = self.timer() + timeout
        while worker_id not in self.observer.cordoned() and self.timer() < deadline:
            await self.wait_for_change(0.1)  # the planner must see the cordon before it plans the move
        moved: set[str] = set()
        while True:
            machines = [m for m in await self.observer.machines_on(worker_id, None) if m.state != "destroyed"]
            if not machines:
                return len(moved)
            if self.timer() > deadline:
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
        copy = await self.machines.create(
            machine.app,
            CreateRequest(
                region=machine.region, config=machine.config, skip_launch=not running, avoid_workers=[machine.worker_id]
            ),
        )
        if running:
            deadline = self.timer() + 60
            while self.timer() < deadline:
                healthy, _ = health(await self.machines.get(machine.app, copy.id))
                if healthy:
                    break
                await asyncio.sleep(0.1)
        progress(f"moved {machine.app}/{machine.id} to {copy.worker_id} as {copy.id}")
        with contextlib.suppress(NotFound):
            await self.machines.destroy(machine.app, machine.id, force=True)
