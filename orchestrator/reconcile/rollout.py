"""Deploy policy: from a spec to a release the app runs, and the way back when it fails.

- `deploy`: first a `preview` (the whole plan, simulated, and whether every region has live workers with
  room for it): a deploy that cannot work fails before it touches anything (`CannotDeploy`), and a spec the
  app already runs claims no release. Then `begin` (claim a release, point the app at it) and `finish`
  (converge; if any region fails, a machine not healthy in time, or one whose process ends on its own: at
  once, point every region back at the previous good release and converge there; with none, remove what the
  deploy created).
- `rollback`: point at an older release and converge; a failed release only when forced, and if the
  rollback fails, back to the last good release.
- `reconcile_once`: finish whatever the current release still needs (a deploy that was killed, a lost host).

Each is a loop of the reconciler's passes (`Reconciler.converge`) with its own stopping rule and its own
bookkeeping of release statuses; `deploy --detach` runs `begin` and `finish` in two processes.

While one of them converges an app it holds the app's claim (`deploying`: key `<app>.deploying`, written again
every third of CLAIM_TTL), and the operators leave the app to it: the deploy owns the app's machines until it
ends. Two reconcilers planning one app at once each created a missing primary and then each destroyed the other's
copy as the surplus, so a region had none (the nemesis on hosts, seed 101). `begin` claims before it points the
app at the new release, so an operator never finds the new release unclaimed. A deploy killed halfway lets go
CLAIM_TTL later at the most, and the operators take over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import msgspec

from bus.contract.errors import Conflict, NotFound
from orchestrator.apps.releases import Head, Release
from orchestrator.apps.spec import AppSpec
from orchestrator.reconcile.actions import Desired, Destroy
from orchestrator.reconcile.observe import ONE_SHOT_PATIENCE
from orchestrator.reconcile.preview import Planned, planned, problems, simulate
from orchestrator.reconcile.reconciler import Converged, Reconciler

SCALED = "scale "  # how `scale` describes the releases it makes
READ_WITHIN = 10.0  # seconds a deploy waits for a region whose workers bucket did not answer (an election: 4 to 9 s)
CLAIM_TTL = 15.0  # seconds an app's claim lasts unless renewed (as a machine's lease, executor.LEASE_TTL)

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def deploying(r: Reconciler, app: str, release: int) -> AsyncIterator[None]:
    """Hold `app`'s claim while the block converges it (renewed every third of CLAIM_TTL; let go at the end)."""
    holder = r.executor.holder
    await r.releases.claim(app, holder, release, CLAIM_TTL)

    async def renew() -> None:
        while True:
            await asyncio.sleep(CLAIM_TTL / 3)
            try:
                await r.releases.claim(app, holder, release, CLAIM_TTL)
            except Exception as exc:  # tried again at the next turn; meanwhile the claim may lapse
                log.info("the claim on %s was not renewed: %r", app, exc)

    renewing = asyncio.create_task(renew())
    try:
        yield
    finally:
        renewing.cancel()
        with contextlib.suppress(Exception):  # unanswered: it lapses by itself
            await r.releases.unclaim(app, holder)


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


async def preview(r: Reconciler, spec: AppSpec) -> Preview:
    """The whole deploy of `spec`, simulated on the fleet as it is, and what stands in its way."""
    current = await r.releases.current(spec.app)
    changes = current is None or current.spec != spec or current.status not in ("complete", "running")
    version = await r.releases.next_version(spec.app) if changes or current is None else current.version
    # a region with no worker known whose bucket did not answer yet (its JetStream electing a leader): waited for,
    # not judged empty
    registry = r.observer.registry
    unknown = {region for region, count in spec.regions.items() if count and not registry.live_ids(region)}
    unread = await registry.read(unknown, READ_WITHIN) if unknown else frozenset()
    observed = await r.observer.observe(spec.app, list(spec.regions), patience=ONE_SHOT_PATIENCE)
    desired = Desired(app=spec.app, release=version, spec=spec)
    now = r.clock()
    return Preview(
        app=spec.app,
        release=version,
        current=current,
        changes=changes,
        actions=planned(desired, observed, now),
        problems=problems(spec, simulate(desired, observed, now), registry.workers(), unread),
        warnings=_scale_warnings(spec, current),
    )


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
    r: Reconciler, spec: AppSpec, description: str = "deploy", *, checked: Preview | None = None, always: bool = False
) -> DeployOutcome:
    """Deploy `spec`: refuse what cannot work (`CannotDeploy`, nothing touched), converge the current
    release when the app already runs this spec (unless `always`: `scale` makes its release anyway,
    a relabel in place), else a new release (see `finish`)."""
    started = r.timer()
    seen = checked or await preview(r, spec)
    if seen.problems:
        raise CannotDeploy(spec.app, seen.problems)
    if not seen.changes and seen.current is not None and not always:
        return await _again(r, seen.current, started)
    release = await begin(r, spec, description)
    outcome = await finish(r, release)
    outcome.seconds = r.timer() - started
    return outcome


async def begin(r: Reconciler, spec: AppSpec, description: str = "deploy") -> Release:
    """Claim a release for `spec` and point the app at it; `finish` converges it. The app is claimed first (for
    CLAIM_TTL: `finish`, perhaps in another process, holds the claim from then on)."""
    head = await r.releases.head(spec.app)
    previous = head.version if head is not None and head.version else None
    release = await r.releases.create(spec, description, previous)
    await r.releases.claim(spec.app, r.executor.holder, release.version, CLAIM_TTL)
    await r.releases.point(spec.app, release.version)
    return release


async def _again(r: Reconciler, current: Release, started: float) -> DeployOutcome:
    """The app already runs this spec: no release, only whatever the current one still needs."""
    app, version = current.app, current.version
    async with deploying(r, app, version):
        result = await r.converge(
            Desired(app=app, release=version, spec=current.spec),
            timeout=r.timeout_for(current.spec),
            exits_since=r.clock(),
        )
    if result.ok and current.status == "running":
        current = await r.releases.set_status(app, version, "complete")
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
        seconds=r.timer() - started,
    )


async def finish(r: Reconciler, release: Release) -> DeployOutcome:
    """Converge the app onto `release` (already current); if it fails, go back to the last good release
    in every region, or, with none, remove the machines it created and leave the app with no current
    release. The failed release keeps status `failed` and its reason. The app's claim is held throughout."""
    async with deploying(r, release.app, release.version):
        return await _finish(r, release)


async def _finish(r: Reconciler, release: Release) -> DeployOutcome:
    started = r.timer()
    app, version, spec = release.app, release.version, release.spec
    result = await r.converge(
        Desired(app=app, release=version, spec=spec), timeout=r.timeout_for(spec), exits_since=r.clock()
    )
    if result.ok:
        release = await r.releases.set_status(app, version, "complete")
        return DeployOutcome(release=release, ok=True, message=f"v{version} deployed", seconds=r.timer() - started)
    errors = result.errors()
    await r.releases.set_status(app, version, "failed", "; ".join(errors))
    target = await _back_from(r, release)
    rolled_back_to = None
    if target is None:
        removed = await _remove(r, release)
        after = f"removed the {removed} machine(s) it created (no earlier good release to roll back to)"
    else:
        back = await _converge_to(r, target)
        regions = ", ".join(sorted(target.spec.regions))
        if back.ok:
            rolled_back_to = target.version
            after = f"rolled back to v{target.version} in every region ({regions})"
        else:
            after = f"rollback to v{target.version} failed too: {back.describe()}"
    lines = [f"v{version} failed: {line}" for line in errors]
    lines[-1] += f"; {after}"
    return DeployOutcome(
        release=await r.releases.get(app, version),
        ok=False,
        message="\n".join(lines),
        errors=errors,
        rolled_back_to=rolled_back_to,
        seconds=r.timer() - started,
    )


async def _back_from(r: Reconciler, release: Release) -> Release | None:
    """Where a failed deploy goes back to: the release the app ran before it, if that one was good, else
    the newest good release before it."""
    if release.previous:
        with contextlib.suppress(NotFound):
            before = await r.releases.get(release.app, release.previous)
            if before.status == "complete":
                return before
    return await r.releases.previous_good(release.app, release.version)


async def _converge_to(r: Reconciler, target: Release) -> Converged:
    """Point the app at `target` and converge; a good release converged onto is complete again."""
    await r.releases.point(target.app, target.version)
    result = await r.converge(
        Desired(app=target.app, release=target.version, spec=target.spec),
        timeout=r.timeout_for(target.spec),
        exits_since=r.clock(),
    )
    if result.ok:
        await r.releases.set_status(target.app, target.version, "complete")  # a failed one stays failed
    return result


async def _remove(r: Reconciler, release: Release) -> int:
    """Destroy the machines labelled with `release` and forget the app's current release, as it was
    before this deploy (machines of the app that no release made are left alone)."""
    app, label = release.app, str(release.version)
    removed = 0
    for _ in range(5):
        observed = await r.observer.observe(app, list(release.spec.regions))
        mine = [m for m in observed.machines if m.release == label]
        if not mine:
            break
        actions = tuple(
            Destroy(id=m.id, region=m.region, worker_id=m.worker_id, reason=f"v{label} failed: removing it")
            for m in mine
        )
        results = await r.executor.apply(app, actions, r.result_hook(app))
        removed += sum(done.ok for done in results)
    head = await r.releases.head(app)
    if head is not None and head.version == release.version:
        await r.releases.forget_head(app)
    return removed


async def rollback_target(r: Reconciler, app: str, version: int | None, *, force: bool = False) -> tuple[Head, Release]:
    """Where a rollback of `app` goes, and the head it leaves; raises if there is none, or (without
    `force`) if that release's deploy failed."""
    head = await r.releases.head(app)
    if head is None:
        if not await r.releases.list(app):
            raise NotFound(f"app {app} has no releases")
        head = Head(app=app, version=0)
    if version is None:
        target = await r.releases.previous_good(app, head.version or 1 << 62)
        if target is None:
            raise NotFound(f"app {app} has no good release before v{head.version} to roll back to")
    else:
        target = await r.releases.get(app, version)
    if target.status == "failed" and not force:
        why = target.reason if len(target.reason) <= 160 else target.reason[:159] + "…"
        raise Conflict(f"v{target.version} failed ({why}): pass --force to roll back to it anyway")
    return head, target


async def rollback(
    r: Reconciler, app: str, version: int | None = None, reason: str = "rollback", *, force: bool = False
) -> DeployOutcome:
    """Point `app` at release `version` (default: the last good one before the current) and converge.

    A failed release is refused unless `force`. If the rollback fails, the app goes back to the release
    it ran before (or the newest good one), and the command says so; no release is relabelled but the
    one rolled back from, and only when the rollback worked (a failed release never is)."""
    started = r.timer()
    head, target = await rollback_target(r, app, version, force=force)
    async with deploying(r, app, target.version):
        return await _rollback(r, head, target, reason, started)


async def _rollback(r: Reconciler, head: Head, target: Release, reason: str, started: float) -> DeployOutcome:
    app = target.app
    before = await r.releases.get(app, head.version) if head.version else None
    result = await _converge_to(r, target)
    if result.ok:
        if before is not None and before.version != target.version:
            note = f"{reason}: back to v{target.version}"
            await r.releases.set_status(app, before.version, "rolled_back", note)
        return DeployOutcome(
            release=await r.releases.get(app, target.version),
            ok=True,
            seconds=r.timer() - started,
            message=f"v{target.version} is current",
        )
    errors = result.errors()
    stays = before is not None and before.status == "complete" and before.version != target.version
    good = before if stays else await r.releases.last_good(app, besides=target.version)
    if good is None:
        after = "no good release to go back to"
    else:
        back = await _converge_to(r, good)
        after = f"back on v{good.version}"
        if not back.ok:
            after = f"going back to v{good.version} failed too: {back.describe()}"
    lines = [f"rollback to v{target.version} failed: {line}" for line in errors]
    lines[-1] += f"; {after}"
    return DeployOutcome(
        release=target,
        ok=False,
        errors=errors,
        seconds=r.timer() - started,
        message="\n".join(lines),
    )


async def reconcile_once(r: Reconciler, app: str, timeout: float = 120.0) -> Converged:
    """Finish whatever the app's current release still needs (a deploy that was killed, a lost host)."""
    desired = await r.desired(app)
    if desired is None:
        raise NotFound(f"app {app} has no releases: deploy it first")
    limit = r.timeout_for(desired.spec) if desired.spec else timeout
    async with deploying(r, app, desired.release):
        result = await r.converge(desired, timeout=limit, until="primaries", exits_since=r.clock())
    if result.ok and desired.spec is not None:
        current = await r.releases.get(app, desired.release)
        if current.status == "running":  # a deploy that was killed halfway, finished now
            await r.releases.set_status(app, desired.release, "complete")
    return result
