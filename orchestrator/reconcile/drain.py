"""Draining a worker: cordon it, then move its machines to other workers of its region, healthy ones first.

Maintenance without downtime. A machine an app's release manages is moved by the planner: the drain steps
the app, and a cordoned worker's primary gets a replacement elsewhere, stopped only once that one passes its
checks. A machine no release manages (made with `machine run`) has no plan to follow, so it is copied here:
the copy first, healthy, then the old one goes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from bus.contract import subjects
from bus.contract.errors import NotFound
from bus.contract.fleet import CordonRequest, CreateRequest, WorkerInfo
from bus.contract.machines import Machine
from orchestrator.client import PROGRESS_CAP
from orchestrator.reconcile.observe import health
from orchestrator.reconcile.reconciler import Reconciler


async def drain_worker(
    r: Reconciler, worker_id: str, *, timeout: float = 300.0, progress: Callable[[str], None] = lambda line: None
) -> int:
    """Cordon `worker_id` and move its machines to other workers of its region; returns how many moved. It
    gives up when `timeout` seconds pass with no machine moved off (docs/explanation/faults.md, "Deadlines
    that follow progress")."""
    info = await r.bus.call(
        subjects.worker_cordon(worker_id, True), CordonRequest(reason="drain"), WorkerInfo, timeout=5
    )
    progress(f"cordoned {worker_id} ({info.region}): it takes no new machines")
    deadline = r.timer() + timeout
    while worker_id not in r.observer.cordoned() and r.timer() < deadline:
        await r.wait_for_change(0.1)  # the planner must see the cordon before it plans the move
    moved: set[str] = set()
    began, fewest = r.timer(), None
    while True:
        machines = [m for m in await r.observer.machines_on(worker_id, None) if m.state != "destroyed"]
        if not machines:
            return len(moved)
        if fewest is None or len(machines) < fewest:  # one more moved off: progress, the clock starts again
            fewest = len(machines)
            deadline = max(deadline, min(r.timer() + timeout, began + PROGRESS_CAP * timeout))
        if r.timer() > deadline:
            raise TimeoutError(f"{len(machines)} machine(s) still on {worker_id}, none moved for {timeout:.0f}s")
        for app in sorted({m.app for m in machines}):
            desired = await r.desired(app)
            if desired is not None and desired.spec is not None:
                await r.step(desired)
            else:
                for m in machines:
                    if m.app == app and m.id not in moved:
                        await move_unmanaged(r, m, progress)
            moved |= {m.id for m in machines if m.app == app}
        await r.wait_for_change(r.poll)


async def move_unmanaged(r: Reconciler, machine: Machine, progress: Callable[[str], None]) -> None:
    """A machine no release manages: a copy elsewhere in its region (healthy first), then the old one goes."""
    running = machine.state in ("started", "starting")
    copy = await r.machines.create(
        machine.app,
        CreateRequest(
            region=machine.region, config=machine.config, skip_launch=not running, avoid_workers=[machine.worker_id]
        ),
    )
    if running:
        deadline = r.timer() + 60
        while r.timer() < deadline:
            healthy, _ = health(await r.machines.get(machine.app, copy.id))
            if healthy:
                break
            await asyncio.sleep(0.1)
    progress(f"moved {machine.app}/{machine.id} to {copy.worker_id} as {copy.id}")
    with contextlib.suppress(NotFound):
        await r.machines.destroy(machine.app, machine.id, force=True)
