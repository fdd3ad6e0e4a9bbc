"""How a job record moves on: pure functions of the record as read, for `JobRecords.change`.

Each returns the new record, or None when the record has moved on meanwhile (a cancel, another worker's
take after this one was presumed lost): then nothing is written, and the caller drops its work.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from bus.contract.jobs import TERMINAL, Job, JobAttempt, retry_delay
from workers.jobs.execute import Outcome

Claim = Callable[[Job], Job | None]  # `claimed` with its arguments bound


def claimed(job: Job, *, worker_id: str, seq: int, now: float, lost_worker: str | None) -> Job | None:
    """Taken by `worker_id` from message `seq`: the next attempt, `running`."""
    if job.state in TERMINAL or job.cancel_requested or (job.queue_seq and job.queue_seq != seq):
        return None
    if job.state == "running" and lost_worker != job.worker_id:
        return None  # someone else took it meanwhile
    attempts = list(job.attempts)
    if job.state == "running" and attempts:
        attempts[-1] = msgspec.structs.replace(attempts[-1], outcome="lost", finished_at=now)
    attempt = job.attempt + 1
    attempts.append(JobAttempt(attempt=attempt, worker_id=worker_id, claimed_at=now))
    return msgspec.structs.replace(
        job,
        state="running",
        attempt=attempt,
        attempts=attempts,
        claimed_at=now,
        started_at=None,
        retry_at=None,
        worker_id=worker_id,
        machine_id=None,
        queue_seq=seq,
        reason=f"attempt {attempt} on {worker_id}" + (f" (worker {lost_worker} was lost)" if lost_worker else ""),
    )


def _mine(job: Job, worker_id: str, attempt: int) -> bool:
    return job.state == "running" and job.worker_id == worker_id and job.attempt == attempt


def running(job: Job, *, worker_id: str, attempt: int, machine_id: str | None, now: float) -> Job | None:
    """Its process runs (the scheduling delay ends here)."""
    if not _mine(job, worker_id, attempt):
        return None
    attempts = list(job.attempts)
    attempts[-1] = msgspec.structs.replace(attempts[-1], machine_id=machine_id, started_at=now)
    return msgspec.structs.replace(job, started_at=now, machine_id=machine_id, attempts=attempts)


def unclaimed(job: Job, *, worker_id: str, attempt: int, reason: str) -> Job | None:
    """It could not start here (no room after all): back to the queue, as if never taken."""
    if not _mine(job, worker_id, attempt):
        return None
    return msgspec.structs.replace(
        job,
        state="queued",
        attempt=attempt - 1,
        attempts=job.attempts[:-1],
        worker_id=None,
        claimed_at=None,
        reason=reason,
    )


def describe(outcome: Outcome, timeout: float) -> tuple[str, str]:
    """(the attempt's outcome word, the reason in words)."""
    if outcome.cancelled:
        return "cancelled", "cancelled while running"
    if outcome.timed_out:
        return "timed out", f"timed out after {timeout:g}s"
    if outcome.error:
        return "failed", outcome.error
    if outcome.success:
        return "succeeded", "exited 0"
    if outcome.signal is not None:
        return "failed", f"killed by signal {outcome.signal}"
    return "failed", f"exited {outcome.exit_code}"


def finished(job: Job, *, worker_id: str, attempt: int, outcome: Outcome, now: float) -> Job | None:
    """The attempt ended: succeeded, cancelled, queued again for a retry, or failed (dead-lettered)."""
    if not _mine(job, worker_id, attempt):
        return None
    word, reason = describe(outcome, job.timeout)
    attempts = list(job.attempts)
    started_at = attempts[-1].started_at or outcome.started_at
    attempts[-1] = msgspec.structs.replace(
        attempts[-1],
        started_at=started_at,
        finished_at=now,
        exit_code=outcome.exit_code,
        signal=outcome.signal,
        outcome=word,
    )
    common = dict(
        started_at=job.started_at or started_at,
        attempts=attempts,
        exit_code=outcome.exit_code,
        signal=outcome.signal,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        machine_id=outcome.machine_id or job.machine_id,
    )
    if outcome.cancelled or job.cancel_requested:
        return msgspec.structs.replace(job, state="cancelled", finished_at=now, reason="cancelled", **common)  # type: ignore[arg-type]
    if outcome.success:
        return msgspec.structs.replace(job, state="succeeded", finished_at=now, reason=reason, **common)  # type: ignore[arg-type]
    if attempt < job.max_attempts:
        delay = retry_delay(attempt)
        return msgspec.structs.replace(
            job,
            state="queued",
            retry_at=now + delay,
            reason=f"attempt {attempt} {reason}; retry in {delay:g}s",
            **common,  # type: ignore[arg-type]
        )
    return msgspec.structs.replace(
        job,
        state="failed",
        finished_at=now,
        dead_lettered=True,
        reason=f"attempt {attempt} of {job.max_attempts} {reason}: dead-lettered",
        **common,  # type: ignore[arg-type]
    )


def settled(job: Job, *, claim: Claim | None, worker_id: str, attempt: int, outcome: Outcome, now: float) -> Job | None:
    """`finished`, for an attempt whose claim may not be written yet (`claim`: the claim it would write; see
    `runner.CLAIM_AFTER`): a record still as the attempt found it is claimed and finished in one write."""
    if not _mine(job, worker_id, attempt):
        taken = claim(job) if claim is not None else None
        if taken is None or not _mine(taken, worker_id, attempt):
            return None  # it moved on meanwhile (a cancel, another worker): this run's outcome is dropped
        job = taken
    return finished(job, worker_id=worker_id, attempt=attempt, outcome=outcome, now=now)


def cancelled_before_run(job: Job, *, now: float) -> Job | None:
    if job.state in TERMINAL:
        return None
    return msgspec.structs.replace(job, state="cancelled", finished_at=now, reason="cancelled before it ran")


def cancel_requested(job: Job, *, now: float) -> Job | None:
    """A user's cancel: a queued job is cancelled at once; a running one is marked for its worker."""
    if job.state in TERMINAL or job.cancel_requested:
        return None
    if job.state == "queued":
        return msgspec.structs.replace(
            job, state="cancelled", cancel_requested=True, finished_at=now, reason="cancelled before it ran"
        )
    return msgspec.structs.replace(job, cancel_requested=True, reason="cancel requested")
