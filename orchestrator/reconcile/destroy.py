"""Destroying an app: every machine of it in every region, then its releases.

The app's head is pointed at release 0, marked destroyed (so an operator that reads it converges to
nothing too, and does not bring a machine back), and the reconciler converges until no machine is left;
only then are the app's releases and head purged. A destroy that fails part way leaves the head so, and
the next destroy finishes it.
"""

from __future__ import annotations

from bus.contract.errors import NotFound
from orchestrator.reconcile.plan import Desired
from orchestrator.reconcile.reconciler import Converged, Reconciler


async def destroy_app(r: Reconciler, app: str, timeout: float = 120.0) -> Converged:
    if await r.releases.head(app) is None and not r.observer.index.by_app(app) and not await r.releases.list(app):
        raise NotFound(f"app {app} not found")
    await r.releases.point(app, 0, destroyed=True)
    result = await r.converge(Desired(app=app, release=0, spec=None), timeout=timeout, until="all")
    if result.ok:
        await r.releases.purge(app)
    return result
