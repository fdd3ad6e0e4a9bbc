"""What a worker does with a job message it was handed: a pure decision, so it is tested without a bus.

The record decides, never the message: JetStream delivers at least once (a redelivery after a worker was
lost, a duplicate publish), and only the record's state and the stream sequence of the message that
holds the job tell a first delivery, a retry, a redelivery and a stray copy apart.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from bus.contract.jobs import TERMINAL, Job

TakeAction = Literal["run", "drop", "later", "cancel"]

# A submit without an idempotency key stores the record and publishes the message at once (two flushed
# writes side by side, not one after the other), so a message may arrive a moment before its record: it
# is asked for again while it is younger than this, then taken for one whose submit failed.
RECORD_GRACE = 30.0


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
            return Take("later", "its record is not stored yet", delay=min(0.25, 0.002 * 2 ** min(deliveries, 8)))
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


def orphan_fence(job: Job) -> float:
    """When a lost worker's attempt is certainly over. A process-runner attempt dies with its worker
    (PR_SET_PDEATHSIG); a machine outlives its worker, but its command runs under `timeout -s KILL`."""
    if job.runner == "process" or job.claimed_at is None:
        return 0.0
    return job.claimed_at + job.timeout + 1.0
