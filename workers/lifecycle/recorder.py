"""The one way a machine changes: under its lock, as a checked transition, committed, then told.

The verbs, the supervisor and resume all change machines, and all must do it the same way: a lock
per machine serialises that machine's verbs, exits and restarts (different machines never wait for
each other); `event` moves a machine to a state only if the lifecycle table allows it and appends
the event that says so; `commit` returns only once the change is durable, then wakes the callers
waiting for the state and hands the records to `on_commit` (the agent publishes from there).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

from bus.contract.machines import CheckStatus, ExitInfo, MachineEvent
from workers.lifecycle.waiters import Waiters
from workers.log.commit import GroupCommitter
from workers.log.machine_states import check_transition
from workers.log.records import LogRecord, StoredMachine
from workers.log.stamps import iso
from workers.log.store import Tx

log = logging.getLogger(__name__)

T = TypeVar("T")

CommitHook = Callable[[list[LogRecord]], None]


class Recorder:
    def __init__(self, committer: GroupCommitter, *, on_commit: CommitHook, clock: Callable[[], float]) -> None:
        self.committer = committer
        self.on_commit = on_commit
        self.clock = clock
        self.waiters = Waiters()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    # ------------------------------------------------------------------------------------------
    # locks

    def lock(self, machine_id: str) -> asyncio.Lock:
        """The machine's lock, made on first use (callers check that the machine exists)."""
        return self._locks[machine_id]

    def forget(self, machine_id: str) -> None:
        """Drop a destroyed machine's lock, unless someone still holds it."""
        lock = self._locks.get(machine_id)
        if lock is not None and not lock.locked():
            self._locks.pop(machine_id, None)

    # ------------------------------------------------------------------------------------------
    # commits

    async def commit(self, fn: Callable[[Tx], T]) -> T:
        result, records = await self.committer.submit(fn)
        if records:
            self._after_commit(records)
        return result

    def _after_commit(self, records: list[LogRecord]) -> None:
        for record in records:
            stored = getattr(record, "stored", None)
            if stored is not None:
                self.waiters.notify(stored.machine)
        try:
            self.on_commit(records)
        except Exception:
            log.exception("on_commit hook failed")

    def event(
        self,
        stored: StoredMachine,
        to: str,
        *,
        source: str = "worker",
        reason: str | None = None,
        exit: ExitInfo | None = None,
        kind: str = "transition",
        check: CheckStatus | None = None,
    ) -> None:
        """Move `stored` to state `to` (checked) and append the event that says so.

        An `update` event carries the new config's metadata (release, role), so the systemwide view
        learns a machine's labels from the event stream alone.
        """
        machine = stored.machine
        previous = machine.state
        if kind == "transition":
            check_transition(machine.id, previous, to)
            machine.state = to  # type: ignore[assignment]
        now = self.clock()
        machine.updated_at = iso(now)
        stored.events.append(
            MachineEvent(
                type=kind,  # type: ignore[arg-type]
                status=machine.state,
                from_state=previous if kind == "transition" else None,
                source=source,  # type: ignore[arg-type]
                reason=reason,
                exit=exit,
                timestamp=round(now * 1000, 3),
                machine_id=machine.id,
                app=machine.app,
                region=machine.region,
                worker_id=machine.worker_id,
                metadata=dict(machine.config.metadata) if kind == "update" else None,
                check=check,
                instance_id=machine.instance_id,
            )
        )
