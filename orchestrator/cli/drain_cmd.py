"""`fauxmad worker drain`, `cordon` and `uncordon`: a worker emptied for maintenance, or kept from new machines.

`worker_cmd` registers them under `fauxmad worker`; the drain is `orchestrator.reconcile.drain`. What only these
commands use is imported when they run: `fauxmad worker` (a worker's own process) imports this module to
register them, and the reconciler and rich's console cost it a tenth of a second at every start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import typer

from orchestrator.cli.runtime import NatsOption, WorkerIdArgument, check_worker_id, fail, with_client

if TYPE_CHECKING:
    from orchestrator.reconcile.reconciler import Reconciler


def drain(
    worker_id: str = typer.Argument(..., help="the worker to empty", callback=check_worker_id),
    timeout: float = typer.Option(300.0, "--timeout", min=1, help="give up after this many seconds"),
    nats: str | None = NatsOption,
) -> None:
    """Cordon a worker and move its machines elsewhere in its region, healthy replacements first.

    Maintenance without downtime: each primary gets a replacement on another worker, and stops only
    once that one passes its checks; spares are re-created elsewhere.
    """
    from orchestrator.cli.app_options import with_reconciler
    from orchestrator.cli.render import console
    from orchestrator.reconcile.drain import drain_worker

    async def go(r: Reconciler) -> int:
        try:
            return await drain_worker(
                r, worker_id, timeout=timeout, progress=lambda line: console.print(line, highlight=False)
            )
        except TimeoutError as exc:
            fail(f"drain of {worker_id} incomplete: {exc}")

    started = time.perf_counter()
    moved = with_reconciler(nats, go)
    console.print(
        f"{worker_id} is drained: {moved} machine(s) moved in {time.perf_counter() - started:.1f}s "
        f"(it stays cordoned; `fauxmad worker uncordon {worker_id}` to use it again)",
        highlight=False,
    )


def cordon(worker_id: str = WorkerIdArgument, uncordon: bool = False, nats: str | None = NatsOption) -> None:
    """Stop (or resume) placing new machines on a worker; what runs there keeps running."""
    from orchestrator.cli.render import console

    info = with_client(nats, lambda c: c.cordon(worker_id, cordoned=not uncordon))
    console.print(
        f"{info.worker_id} ({info.region}) is {'cordoned' if info.cordoned else 'taking machines'}", highlight=False
    )
