"""What a worker does with a job message it was handed: a pure decision, so it is tested without a bus.

The record decides, never the message: JetStream delivers at least once (a redelivery after a worker was
lost, a duplicate publish), and only the record's state and the stream sequence of the message that
holds the job tell a first delivery, a retry, a redelivery and a stray copy apart.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from bus.contract.jobs import TERMINAL, Job, JobTask

TakeAction = Literal["run", "drop", "later", "cancel"]

# A submit writes no record (issue 44): its message carries the job as submitted (`JobTask.job`), which is the
# job's record until a worker takes it and writes the first (`as_submitted`). A message without it (published
# by an older worker beside a record written at its submit) may be handed to a worker a moment before its
# record is stored: it is asked for again (`record_wait`) while younger than this, then taken for one whose
# submit failed.
RECORD_GRACE = 30.0
RECORD_WAIT_FIRST = 0.002  # seconds before the first look again for a record not stored yet, doubling
RECORD_WAIT_MOST = 0.25
# A message younger than this runs from the record it carries without reading the record first: the window in
# which a cancel may not stop a fast-path job from starting (the same as `guard.CLAIM_AFTER`'s).
CARRIED_FRESH = 0.05


class Take(msgspec.Struct, frozen=True):
    action: TakeAction  # run it; drop the message (ack, nothing to do); later (nak with `delay`); cancel it
    reason: str
    delay: float = 0.0
    lost_worker: str | None = None  # a redelivery: the worker that held it before (its attempt is marked lost)


def decide(
    job: Job | None, seq: int, now: float, *, holder_alive: bool, age: float = RECORD_GRACE, deliveries: int = 1
) -> Take:
    """`seq`: the stream sequence of the delivered message; `holder_alive`: the worker named in a running
    record still beats (asked only for a redelivery); `age`: seconds since the message was published;
    `deliveries`: how many times it was delivered, this one included."""
    if job is None:
        if age < RECORD_GRACE:  # its record is being stored: ask again soon, then less often
            return Take("later", "its record is not stored yet", delay=record_wait(deliveries))
        return Take("drop", "no record: the submit that published it failed")
    if job.state in TERMINAL:
        return Take("drop", f"already {job.state}")
    if job.queue_seq and job.queue_seq != seq:
        return Take("drop", f"a stray copy: the job is held by message {job.queue_seq}")
    if job.cancel_requested:
        return Take("cancel", "cancelled before it ran")
    if job.state == "queued":
        if job.retry_at is not None and now < job.retry_at:
            return Take("later", "waiting out its retry back-off", delay=job.retry_at - now)
        return Take("run", "queued")
    # running, and delivered again: the worker that took it stopped renewing it
    if holder_alive:
        return Take("later", f"worker {job.worker_id} still holds it", delay=1.0)
    fence = orphan_fence(job)
    if now < fence:  # the lost worker's attempt may still be running: never twice at once
        return Take("later", "the lost worker's attempt may still be running", delay=fence - now)
    return Take("run", f"worker {job.worker_id} was lost mid-task", lost_worker=job.worker_id)


def record_wait(deliveries: int) -> float:
    """Seconds before a message whose record is not stored yet is delivered again, after its `deliveries`-th
    delivery (from 1): 2 ms, doubling, at most 0.25 s."""
    return float(min(RECORD_WAIT_MOST, RECORD_WAIT_FIRST * 2 ** min(max(deliveries, 1) - 1, 16)))


def carried(task: JobTask, *, age: float, deliveries: int, fresh_for: float = CARRIED_FRESH) -> Job | None:
    """The record a message carries, if the worker may run from it without reading the record first: a first
    delivery younger than `fresh_for` (a redelivery, or a message that waited in the queue, may find its
    record moved on: a cancel, a lost worker) whose record is of its own job, still as submitted. `age` is this
    host's clock against the server's: a clock behind by more than `fresh_for` (a negative age) proves nothing."""
    if deliveries != 1 or not -fresh_for < age < fresh_for:
        return None
    return as_submitted(task)


def as_submitted(task: JobTask) -> Job | None:
    """The record a message carries, if it is of its own job and as submitted: the job's record while none is
    written (a submit writes none since issue 44: the worker that takes it writes the first)."""
    job = task.job
    if isinstance(job, msgspec.UnsetType):
        return None
    if job.id != task.id or job.app != task.app or job.state != "queued" or job.attempt != 0:
        return None
    return job


def orphan_fence(job: Job) -> float:
    """When a lost worker's attempt is certainly over. A process-runner attempt dies with its worker
    (PR_SET_PDEATHSIG); a machine outlives its worker, but its command runs under `timeout -s KILL`."""
    if job.runner == "process" or job.claimed_at is None:
        return 0.0
    return job.claimed_at + job.timeout + 1.0
