"""One delivered job message, carried through one attempt: decide, claim, run, record, then ack.

Order is what makes it safe. The record decides whether to run (`take`), and every write to it is a
compare-and-set, so a cancel and a worker never overwrite each other. A machine attempt is claimed in the
record before it starts; a `process` attempt, which dies with its worker, is claimed only if it still runs
after `guard.CLAIM_AFTER` (a short one is claimed and finished in one write). The outcome is recorded
before the ack, so a worker killed between the two leaves a record that says what happened, and the
redelivery is dropped (so a plain ack, not a confirmed one, is enough). While it runs, the `Guard` renews
the message, so a slow task is never redelivered, and ends an attempt that lost its hold on the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from bus.contract import subjects
from bus.contract.beats import member_beat
from bus.contract.codec import decode, encode
from bus.contract.errors import FauxmadError
from bus.contract.fleet import WorkerInfo
from bus.contract.jobs import Job, JobTask, event_of, retry_delay
from bus.transport.nats_adapter import Bucket, Nats
from workers.jobs import outcome as moves
from workers.jobs.execute import Executor, Outcome
from workers.jobs.guard import Guard
from workers.jobs.puller import hand_back
from workers.jobs.records import Change, JobRecords
from workers.jobs.spawn import Cancel
from workers.jobs.take import CARRIED_FRESH, RECORD_GRACE, as_submitted, carried, decide

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(
        self,
        nc: Nats,
        records: JobRecords,
        executors: dict[str, Executor],
        *,
        worker_id: str,
        region: str,
        workers_kv: Bucket,
        ack_wait: float,
        clock: Callable[[], float] = time.time,
        carried_fresh: float = CARRIED_FRESH,
    ) -> None:
        """`carried_fresh`: a message younger than this runs from the record it carries (`take.carried`)."""
        self.nc = nc
        self.js = nc.jetstream()
        self.records = records
        self.executors = executors
        self.worker_id = worker_id
        self.region = region
        self.workers_kv = workers_kv
        self.ack_wait = ack_wait
        self.clock = clock
        self.carried_fresh = carried_fresh
        self.cancels: dict[str, Cancel] = {}
        self.ran = 0
        self._started: set[int] = set()  # the messages (ids) whose attempt has begun to run here

    def cancel(self, job_id: str) -> bool:
        """Cancel the attempt running here, if any."""
        event = self.cancels.get(job_id)
        if event is None:
            return False
        event.set()
        return True

    async def emit(self, job: Job) -> None:
        """The job's new state on its events subject (a core publish: the record is the truth; awaited, not a
        task of its own: it only appends to the connection's buffer)."""
        if not self.nc.is_connected:
            return
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.job_events(job.region, job.app, job.id), encode(event_of(job, self.clock())))

    async def _holder_alive(self, job: Job | None) -> bool:
        if job is None or job.state != "running" or not job.worker_id:
            return False
        if job.worker_id == self.worker_id:
            return job.id in self.cancels
        beat = await self._beat_of(job.region, job.worker_id)
        if beat is None:
            return False
        info = decode(WorkerInfo, beat)
        # beating (its entry is there: the registry's TTL, on the server's clock, removes a silent worker's; its
        # heartbeat_at is its own clock's, which may be off this one's), and the same process that claimed it
        # (a worker restarted since has forgotten it; both times are the holder's own clock)
        return job.claimed_at is None or info.started_at < job.claimed_at

    async def _beat_of(self, region: str, worker_id: str) -> bytes | None:
        """A worker's heartbeat: under its own key, or in its process's beat group (logical workers,
        `bus.contract.beats`), which is named after its first worker, the process's one job puller."""
        with contextlib.suppress(Exception):
            entry = await self.workers_kv.get(subjects.worker_key(region, worker_id))
            if entry.value:
                return bytes(entry.value)
        with contextlib.suppress(Exception):
            entry = await self.workers_kv.get(subjects.group_key(region, worker_id))
            if entry.value:
                return member_beat(entry.value, worker_id)
        return None

    async def handle(self, msg: Any, release: Callable[[], None] = lambda: None) -> None:
        """Carry one delivered message through; `release` frees its slot once its process has ended.

        Cancelled (the worker stops) before its attempt began to run here, the message goes back to the queue at
        once (a nak without delay), for another worker: not after the ack wait."""
        try:
            await self._handle(msg, release)
        except asyncio.CancelledError:
            if id(msg) not in self._started:
                await hand_back(msg)
            raise
        except Exception:
            log.warning("job message on %s: not handled (it will be delivered again)", msg.subject, exc_info=True)
        finally:
            self._started.discard(id(msg))

    async def _handle(self, msg: Any, release: Callable[[], None]) -> None:
        try:
            task = decode(JobTask, msg.data)
        except FauxmadError:
            await msg.term()  # not a job: never deliver it again
            return
        meta = msg.metadata
        seq = meta.sequence.stream
        now = self.clock()
        age = now - meta.timestamp.timestamp() if meta.timestamp is not None else RECORD_GRACE
        deliveries = meta.num_delivered or 1
        fresh = carried(task, age=age, deliveries=deliveries, fresh_for=self.carried_fresh)
        found: tuple[Job, int] | None = None
        if fresh is not None:  # run from the record it carries: no read before the run (its claim reads it)
            take = decide(fresh, seq, now, holder_alive=False, age=age, deliveries=deliveries)
        else:
            found = await self.records.read(task.app, task.id)
            job = found[0] if found else None
            if job is None:  # no record yet: the message's job as submitted is its record (the first write makes it)
                job = fresh = as_submitted(task)
            holder_alive = await self._holder_alive(job)
            take = decide(job, seq, now, holder_alive=holder_alive, age=age, deliveries=deliveries)
        if take.action == "drop":
            await msg.ack()
        elif take.action == "later":
            await msg.nak(delay=take.delay)  # the decision's own delay: 2 ms for a record not stored yet
        elif take.action == "cancel":
            now = self.clock()
            job, changed = await self.records.change(
                task.app, task.id, lambda j: moves.cancelled_before_run(j, now=now), absent=fresh
            )
            if changed:
                await self.emit(job)
            await msg.ack()
        else:
            await self._run(msg, task, seq, take.lost_worker, found, release, fresh)

    async def _run(
        self,
        msg: Any,
        task: JobTask,
        seq: int,
        lost_worker: str | None,
        read: tuple[Job, int] | None,
        release: Callable[[], None],
        fresh: Job | None = None,
    ) -> None:
        """`read`: the record as read (and its revision); `fresh`: else, the record its message carries, not read
        (the first write reads it, or writes it if the submit's write has not landed yet)."""
        now = self.clock()

        def claim(j: Job) -> Job | None:
            return moves.claimed(j, worker_id=self.worker_id, seq=seq, now=now, lost_worker=lost_worker)

        known: tuple[Job, int] | None
        base = read[0] if read is not None else fresh
        deferred = base is not None and base.runner == "process"
        if deferred:  # the fast path: run at once, claim in the record only if it still runs later (guard)
            assert base is not None
            # no record read (a fresh message), or none there when read: the first write is made as a
            # compare-and-set on "no value yet" (revision 0) without reading first; a record written meanwhile (a
            # cancel) fails it, and it is read then and decided again (`JobRecords.change_from`): one request less
            taken = claim(base)
            known = read if read is not None else (base, 0) if fresh is not None else None
            if taken is None:
                await msg.nak(delay=0.05)
                return
            job = taken
        else:  # a machine may outlive this worker: its claim is written before it starts
            job, changed, revision = await self.records.change_from(task.app, task.id, claim, read, absent=fresh)
            if not changed:
                await msg.nak(delay=0.05)  # it moved on meanwhile: the next delivery decides again
                return
            known = (job, revision)
        await self.emit(job)  # `running` on the events subject at once, even where the record says so later
        attempt = job.attempt
        cancel = self.cancels[job.id] = Cancel()
        guard = Guard(
            records=self.records,
            nc=self.nc,
            msg=msg,
            job=job,
            known=known,
            claim=claim if deferred else None,
            absent=fresh,
            cancel=cancel,
            ack_wait=self.ack_wait,
            clock=self.clock,
        )
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

            marks.append(asyncio.create_task(self._mark(job, change, known)))

        self._started.add(id(msg))
        try:
            outcome = await self.executors[job.runner].run(job, attempt, cancel, started)
        finally:
            release()
            await guard.stop()
            self.cancels.pop(job.id, None)
        known = await self._marked(marks, guard.known)
        self.ran += 1
        if guard.fenced:
            log.warning("job %s: lost its hold on the queue; attempt %d abandoned", job.id, attempt)
            return
        outcome.started_at = began[0] if began else None
        await self._record(msg, job, attempt, outcome, known, guard.claim, fresh)

    async def _mark(self, job: Job, change: Change, known: tuple[Job, int] | None) -> tuple[Job, bool, int]:
        """Write that its machine runs, and say so on the events subject as soon as the write lands: said when
        the run ended (as it was), it came after a cancel's event, a second `running` after `cancel requested`
        (issue 41). A record a cancel was asked of already said `running`: its event is the last word."""
        marked, ok, revision = await self.records.change_from(job.app, job.id, change, known)
        if ok and not marked.cancel_requested:
            await self.emit(marked)
        return marked, ok, revision

    async def _marked(
        self, marks: list[asyncio.Task[tuple[Job, bool, int]]], known: tuple[Job, int] | None
    ) -> tuple[Job, int] | None:
        for mark_task in marks:
            try:
                marked, _, marked_revision = await mark_task
            except Exception:
                known = None
                continue
            known = (marked, marked_revision)
        return known

    async def _record(
        self,
        msg: Any,
        job: Job,
        attempt: int,
        outcome: Outcome,
        known: tuple[Job, int] | None,
        claim: moves.Claim | None,
        fresh: Job | None = None,
    ) -> None:
        if outcome.no_room:
            new, ok = await self.records.change(
                job.app,
                job.id,
                lambda j: moves.unclaimed(j, worker_id=self.worker_id, attempt=attempt, reason=outcome.error),
                absent=fresh,
            )
            await msg.nak(delay=0.2)
            return
        now = self.clock()

        def settle(j: Job) -> Job | None:
            return moves.settled(j, claim=claim, worker_id=self.worker_id, attempt=attempt, outcome=outcome, now=now)

        new, ok, _ = await self.records.change_from(job.app, job.id, settle, known, absent=fresh)
        if not ok:
            await msg.nak(delay=0.05)
            return
        await self.emit(new)
        if new.state == "queued":
            await msg.nak(delay=retry_delay(attempt))
            return
        if new.dead_lettered:
            await self.js.publish(subjects.jobs_dead(new.region, new.app), encode(new))
        # a plain ack: if it is lost, the redelivery finds the record finished and is dropped
        await msg.ack()
