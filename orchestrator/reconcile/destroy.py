"""Destroying an app: every machine of it in every region, then its releases.

The app's head is pointed at release 0, marked destroyed (so an operator that reads it converges to
nothing too, and does not bring a machine back), and the reconciler converges until no machine is left;
only then are the app's releases and head purged. The plan counts a machine that is `destroying` as gone
(nothing more to ask of it), so the destroy then waits, within the same timeout, until the live workers list
none of the app's machines in that state: when `apps destroy` returns, no process of the app is left on a live
worker. A destroy that fails part way leaves the head so, and the next destroy finishes it.
"""

from __future__ import annotations

import msgspec

from bus.contract.errors import NotFound
from orchestrator.reconcile.actions import Desired, Failure
from orchestrator.reconcile.reconciler import Converged, Reconciler


async def destroy_app(r: Reconciler, app: str, timeout: float = 120.0) -> Converged:
    if await r.releases.head(app) is None and not r.observer.index.by_app(app) and not await r.releases.list(app):
        raise NotFound(f"app {app} not found")
    await r.releases.point(app, 0, destroyed=True)
    started = r.timer()
    result = await r.converge(Desired(app=app, release=0, spec=None), timeout=timeout, until="all")
    if result.ok:
        result = await _until_none_left(r, app, result, started + timeout)
    if result.ok:
        await r.releases.purge(app)
    return result


async def _until_none_left(r: Reconciler, app: str, result: Converged, deadline: float) -> Converged:
    """Wait for the machines still `destroying` (their processes ending) to be destroyed, or fail at `deadline`."""
    while True:
        observed = await r.observer.observe(app, [])
        left = [m for m in observed.machines if m.state == "destroying"]  # (a lost worker's are not waited for)
        if not left:
            return result
        if r.timer() > deadline:
            failures = [Failure(region=m.region, machine_id=m.id, reason=f"still {m.state}") for m in left]
            return msgspec.structs.replace(result, ok=False, failures=failures)
        await r.wait_for_change(r.poll)
