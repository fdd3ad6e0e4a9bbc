"""What watches one attempt while it runs: its claim in the record, and its hold on the queue message.

- *The hold.* The message is renewed (`+WPI`, then a flush: the server has it) every third of the ack wait,
  so a slow task is never redelivered. An attempt that cannot renew (cut off from NATS) for most of the ack
  wait is ended and `fenced`: its worker walks away without recording or acking, and the redelivery
  elsewhere is the only run.
- *The claim.* A machine attempt is claimed before it starts (its machine outlives the worker). A `process`
  attempt (it dies with its worker) is claimed only once it has run `CLAIM_AFTER`; a shorter one is claimed
  and finished in one write (`outcome.settled`). If the record moved on before the claim (a cancel), the
  attempt is ended.

Most jobs of the fast path end within milliseconds, so nothing runs for them here but one timer: the task
that claims and renews starts when the timer fires, not with the attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from bus.contract.errors import FauxmadError
from bus.contract.jobs import Job
from bus.transport.nats_adapter import Nats
from workers.jobs import outcome as moves
from workers.jobs.records import JobRecords
from workers.jobs.spawn import Cancel

log = logging.getLogger(__name__)

# How long a `process` attempt runs before its claim is written. The price of not writing it at once: for
# its first CLAIM_AFTER a running job reads `queued` (a cancel then finds it queued: it is recorded
# `cancelled`, and the run is ended when its claim finds that, or its outcome dropped if it ended first), and
# a worker killed in that time leaves no `lost` attempt in the record (the redelivery runs the same attempt
# number again). What it buys: a short job's record is written once, not twice, and one flushed write less
# stands between the queue and its process.
CLAIM_AFTER = 0.05


class Guard:
    def __init__(
        self,
        *,
        records: JobRecords,
        nc: Nats,
        msg: Any,
        job: Job,
        known: tuple[Job, int] | None,
        claim: moves.Claim | None,
        cancel: Cancel,
        absent: Job | None = None,
        ack_wait: float,
        clock: Callable[[], float],
    ) -> None:
        """`known`: the record as last read or written (and its revision); `claim`: the claim still to write
        (None: it is written); `absent`: the record its message carried, written by the claim if the submit's
        write has not landed yet."""
        self.records, self.nc, self.msg, self.job = records, nc, msg, job
        self.known = known
        self.absent = absent
        self.claim = claim
        self.cancel = cancel
        self.ack_wait, self.clock = ack_wait, clock
        self.fenced = False  # it lost its hold on the queue: record nothing, ack nothing
        self._confirmed = clock()
        self._task: asyncio.Task[None] | None = None
        first = CLAIM_AFTER if claim is not None else self.every
        self._timer = asyncio.get_running_loop().call_later(first, self._start)

    @property
    def every(self) -> float:
        return self.ack_wait / 3

    def _start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        if self.claim is not None:
            if not await self._claim():
                return
            await asyncio.sleep(max(0.0, self.every - CLAIM_AFTER))
        while await self._renew():
            await asyncio.sleep(self.every)

    async def _claim(self) -> bool:
        """Write the claim; False (and the attempt ended) if the record moved on meanwhile."""
        assert self.claim is not None
        job = self.job
        while True:
            try:
                claimed, ok, revision = await self.records.change_from(
                    job.app, job.id, self.claim, self.known, absent=self.absent
                )
            except FauxmadError as exc:
                log.warning("job %s: its claim was not written (%s); trying again", job.id, exc.message)
                self.known = None
                await asyncio.sleep(CLAIM_AFTER)
                continue
            if not ok:
                log.info("job %s moved on before its claim (%s): ending attempt %d", job.id, claimed.state, job.attempt)
                self.cancel.set()
                return False
            self.known, self.claim = (claimed, revision), None  # its `running` event went out at the start
            return True

    async def _renew(self) -> bool:
        try:
            await self.msg.in_progress()
            await self.nc.flush(timeout=max(1, round(self.every)))
            self._confirmed = self.clock()
        except Exception:
            if self.clock() - self._confirmed > self.ack_wait * 0.6:
                self.fenced = True
                self.cancel.set()
                return False
        return True

    async def stop(self) -> None:
        """The attempt ended: stop watching. A claim write cut short may still land; the outcome's
        compare-and-set then reads the record again and sees it."""
        self._timer.cancel()
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
