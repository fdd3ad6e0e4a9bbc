"""One delivered job message, carried through one attempt: decide, claim, run, record, then ack.

Order is what makes it safe. The record is claimed (compare-and-set) before anything runs, so two
workers never both run an attempt; the outcome is recorded before the ack, so a worker killed between
the two leaves a record that says what happened, and the redelivery is dropped (so a plain ack, not a
confirmed one, is enough). While it runs, the
message is renewed (`+WPI`, then a flush: the server has it) every third of the ack wait: a slow task
is never redelivered. A worker that cannot renew (cut off from NATS) for most of the ack wait kills its
attempt and walks away without recording or acking: the redelivery elsewhere is then the only run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client

from bus import subjects
from bus.codec import decode, encode
from bus.errors import FauxmadError
from bus.jetstream import WORKER_TTL
from bus.jobs import Job, JobTask, event_of, retry_delay
from bus.messages import WorkerInfo
from workers.jobs import outcome as moves
from workers.jobs.execute import Executor, Outcome
from workers.jobs.records import JobRecords
from workers.jobs.take import RECORD_GRACE, decide

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(
        self,
        nc: Client,
        records: JobRecords,
        executors: dict[str, Executor],
        *,
        worker_id: str,
        region: str,
        workers_kv: Any,
        ack_wait: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.records = records
        self.executors = executors
        self.worker_id = worker_id
        self.region = region
        self.workers_kv = workers_kv
        self.ack_wait = ack_wait
        self.clock = clock
        self.cancels: dict[str, asyncio.Event] = {}
        self.ran = 0

    def cancel(self, job_id: str) -> bool:
        """Cancel the attempt running here, if any."""
        event = self.cancels.get(job_id)
        if event is None:
            return False
        event.set()
        return True

    def emit(self, job: Job) -> None:
        """The job's new state on its events subject (a core publish: the record is the truth)."""
        if not self.nc.is_connected:
            return
        subject = subjects.job_events(job.region, job.app, job.id)
        task = asyncio.ensure_future(self.nc.publish(subject, encode(event_of(job, self.clock()))))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _holder_alive(self, job: Job | None) -> bool:
        if job is None or job.state != "running" or not job.worker_id:
            return False
        if job.worker_id == self.worker_id:
            return job.id in self.cancels
        try:
            entry = await self.workers_kv.get(subjects.worker_key(job.region, job.worker_id))
        except Exception:
            return False
        if not entry.value:
            return False
        info = decode(WorkerInfo, entry.value)
        # beating, and the same process that claimed it (a worker restarted since has forgotten it)
        fresh = self.clock() - info.heartbeat_at < WORKER_TTL + 1.0
        return fresh and (job.claimed_at is None or info.started_at < job.claimed_at)

    async def handle(self, msg: Any) -> None:
        try:
            await self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("job message on %s: not handled (it will be delivered again)", msg.subject, exc_info=True)

    async def _handle(self, msg: Any) -> None:
        try:
            task = decode(JobTask, msg.data)
        except FauxmadError:
            await msg.term()  # not a job: never deliver it again
            return
        meta = msg.metadata
        seq = meta.sequence.stream
        found = await self.records.read(task.app, task.id)
        job = found[0] if found else None
        now = self.clock()
        age = now - meta.timestamp.timestamp() if meta.timestamp is not None else RECORD_GRACE
        take = decide(
            job, seq, now, holder_alive=await self._holder_alive(job), age=age, deliveries=meta.num_delivered or 1
        )
        if take.action == "drop":
            await msg.ack()
        elif take.action == "later":
            await msg.nak(delay=max(0.05, take.delay))
        elif take.action == "cancel":
            now = self.clock()
            job, changed = await self.records.change(
                task.app, task.id, lambda j: moves.cancelled_before_run(j, now=now)
            )
            if changed:
                self.emit(job)
            await msg.ack()
        else:
            await self._run(msg, task, seq, take.lost_worker, found)

    async def _run(
        self, msg: Any, task: JobTask, seq: int, lost_worker: str | None, read: tuple[Job, int] | None
    ) -> None:
        now = self.clock()
        job, changed, revision = await self.records.change_from(
            task.app,
            task.id,
            lambda j: moves.claimed(j, worker_id=self.worker_id, seq=seq, now=now, lost_worker=lost_worker),
            read,
        )
        if not changed:
            await msg.nak(delay=0.05)  # it moved on meanwhile: the next delivery decides again
            return
        self.emit(job)
        attempt = job.attempt
        cancel = self.cancels[job.id] = asyncio.Event()
        fenced = asyncio.Event()
        renew = asyncio.create_task(self._renew(msg, cancel, fenced))
        marks: list[asyncio.Task[tuple[Job, bool, int]]] = []
        began: list[float] = []

        def started(machine_id: str | None) -> None:
            """Its process runs: a machine's id is written at once (for `job logs`, `cancel`); a plain
            process's start time goes with its outcome (one write less per job on the fast path)."""
            at = self.clock()
            began.append(at)
            if machine_id is None:
                return

            def change(j: Job) -> Job | None:
                return moves.running(j, worker_id=self.worker_id, attempt=attempt, machine_id=machine_id, now=at)

            marks.append(asyncio.create_task(self.records.change_from(job.app, job.id, change, (job, revision))))

        try:
            outcome = await self.executors[job.runner].run(job, attempt, cancel, started)
        finally:
            renew.cancel()
            self.cancels.pop(job.id, None)
        known: tuple[Job, int] | None = (job, revision)
        for mark_task in marks:
            try:
                marked, ok, marked_revision = await mark_task
            except Exception:
                known = None
                continue
            known = (marked, marked_revision)
            if ok:
                self.emit(marked)
        self.ran += 1
        if fenced.is_set():
            log.warning("job %s: lost its hold on the queue; attempt %d abandoned", job.id, attempt)
            return
        outcome.started_at = began[0] if began else None
        await self._record(msg, job, attempt, outcome, known)

    async def _record(self, msg: Any, job: Job, attempt: int, outcome: Outcome, known: tuple[Job, int] | None) -> None:
        if outcome.no_room:
            new, ok = await self.records.change(
                job.app,
                job.id,
                lambda j: moves.unclaimed(j, worker_id=self.worker_id, attempt=attempt, reason=outcome.error),
            )
            await msg.nak(delay=0.2)
            return
        now = self.clock()
        new, ok, _ = await self.records.change_from(
            job.app,
            job.id,
            lambda j: moves.finished(j, worker_id=self.worker_id, attempt=attempt, outcome=outcome, now=now),
            known,
        )
        if not ok:
            await msg.nak(delay=0.05)
            return
        self.emit(new)
        if new.state == "queued":
            await msg.nak(delay=retry_delay(attempt))
            return
        if new.dead_lettered:
            await self.js.publish(subjects.jobs_dead(new.region, new.app), encode(new))
        # a plain ack: if it is lost, the redelivery finds the record finished and is dropped
        await msg.ack()

    async def _renew(self, msg: Any, cancel: asyncio.Event, fenced: asyncio.Event) -> None:
        confirmed = self.clock()
        every = self.ack_wait / 3
        while True:
            await asyncio.sleep(every)
            try:
                await msg.in_progress()
                await self.nc.flush(timeout=max(1, round(every)))
                confirmed = self.clock()
            except Exception:
                if self.clock() - confirmed > self.ack_wait * 0.6:
                    fenced.set()
                    cancel.set()
                    return
