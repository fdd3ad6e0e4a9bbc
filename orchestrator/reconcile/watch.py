"""The operator (`reconcile --watch`): step every app whenever something changes, until told to stop.

A worker's heartbeat expiring (its spares start), a machine's event, a new release: each wakes the reconciler
(see `follow`), and the operator steps every app again, with a timer only as a backstop. It must keep going
when the desired state does not answer, as in a supercluster region cut off from the home region that keeps
the apps bucket: it then converges to the last release it saw, from its last read or the apps watch.

An app a deploy (or rollback) is converging is left to it while its claim holds (`rollout.deploying`): two
reconcilers planning one app at once each created the missing primary, then each destroyed the other's copy.

It rides out a nats-server restart (its connection reconnects forever, see `reconciler`); if the connection
closes for good, `watch` raises `Unreachable` saying so, and `reconcile --watch` exits non-zero for its
supervisor to restart it: alive but deaf, it would fail every pass and replace nothing.
"""

from __future__ import annotations

import asyncio
import logging

from orchestrator.reconcile.actions import Desired
from orchestrator.reconcile.reconciler import Reconciler, desired_from

log = logging.getLogger(__name__)

DESIRED_TIMEOUT = 5.0  # seconds the operator waits for the desired state before using the last it read
DESIRED_RETRY = 5.0  # seconds it then uses the last one without asking
# seconds a pass waits for a create's answer (its own wait is 35 s) before it leaves the create to go on and
# plans again: a create lost on the way (a nats-server restarting) held the operator's every other action that long
# (a stale primary back beside its promoted spare, in CI). A create takes well under a second on a loaded host.
CREATE_PATIENCE = 10.0


class Operator:
    """One operator over a reconciler; it remembers the last desired state it read, for when reads fail."""

    def __init__(self, reconciler: Reconciler) -> None:
        self.reconciler = reconciler
        reconciler.executor.create_patience = CREATE_PATIENCE
        self._last_desired: dict[str, Desired] = {}
        self._known_apps: set[str] = set()  # the last app list read
        self._desired_quiet_until = 0.0
        self._deferred: dict[str, int] = {}  # app -> the release a deploy converges it onto, while the operator waits

    async def watch(self, apps: list[str] | None, stop: asyncio.Event) -> None:
        """Step every app (or `apps`) whenever anything changes, until `stop` is set; raises `Unreachable` if
        the connection closes for good."""
        r = self.reconciler
        while not stop.is_set():
            r.check_connected()
            busy = False
            for app in apps if apps is not None else await self._apps():
                try:
                    if await self._claimed(app):
                        busy = True  # look again soon: the claim goes when the deploy ends
                        continue
                    desired = await self._desired_or_last(app)
                    if desired is None:
                        continue
                    result, _ = await r.step(desired)
                    busy = busy or bool(result.actions or result.waiting)
                except Exception as exc:
                    r.check_connected()
                    log.warning("reconcile %s: %s (will look again)", app, exc)
                    busy = True
            waiter = asyncio.create_task(r.wait_for_change(r.poll if busy else r.backstop))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            for task in (waiter, stopper):
                task.cancel()

    async def _apps(self) -> list[str]:
        """The apps with releases; while the desired state does not answer (a supercluster's region cut off from
        the home region, which keeps it), the last list seen and the apps the apps watch brought since."""
        r = self.reconciler
        if r.timer() >= self._desired_quiet_until:
            try:
                self._known_apps = set(await asyncio.wait_for(r.releases.apps(), DESIRED_TIMEOUT))
                return sorted(self._known_apps)
            except Exception as exc:
                self._desired_quiet_until = r.timer() + DESIRED_RETRY
                log.warning("the app list did not answer (%r): using the last one seen", exc)
        return sorted(self._known_apps | r.watched.apps())

    async def _claimed(self, app: str) -> bool:
        """Whether a deploy (or rollback) holds `app` now. Read from the bucket (the apps watch may not have brought a
        claim written a moment ago), or while the bucket does not answer, from the apps watch."""
        r = self.reconciler
        claim = r.watched.claim(app)
        if r.timer() >= self._desired_quiet_until:
            try:
                claim = await asyncio.wait_for(r.releases.claim_of(app), DESIRED_TIMEOUT)
            except Exception as exc:
                self._desired_quiet_until = r.timer() + DESIRED_RETRY
                log.info("the claim on %s did not answer (%r): using the apps watch's", app, exc)
        if claim is None or not claim.live(r.clock()) or claim.holder == r.executor.holder:
            self._deferred.pop(app, None)
            return False
        if self._deferred.get(app) != claim.release:  # said once per deploy
            log.info("%s: left to %s while it converges release %d", app, claim.holder, claim.release)
            self._deferred[app] = claim.release
        return True

    async def _desired_or_last(self, app: str) -> Desired | None:
        """`desired(app)`, or the last one read while the desired state does not answer: a region cut off from
        the home region keeps converging to the release it last saw (it cannot see a newer one anyway). After a
        read that did not answer, the last one is used at once for `DESIRED_RETRY` seconds: a pass is not held
        up by a timeout each time. The apps watch's view goes before the last read: it is at least as new, and an
        operator whose reads failed from its start (its JetStream still electing when the cut began) has no other."""
        r = self.reconciler
        last = self._watched_desired(app) or self._last_desired.get(app)
        if last is not None and r.timer() < self._desired_quiet_until:
            return last
        try:
            desired = await asyncio.wait_for(r.desired(app), DESIRED_TIMEOUT)
        except Exception as exc:
            self._desired_quiet_until = r.timer() + DESIRED_RETRY
            if last is None:
                raise
            log.info("the desired state of %s did not answer (%r): converging to release %d", app, exc, last.release)
            return last
        if desired is not None:
            self._last_desired[app] = desired
        return desired

    def _watched_desired(self, app: str) -> Desired | None:
        watched = self.reconciler.watched
        head = watched.head(app)
        return desired_from(app, head, watched.release(app, head.version) if head is not None else None)
