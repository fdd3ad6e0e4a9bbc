"""Background jobs on the bus (an addition to the contract): the message types and the job's life.

A job is a command to run to completion once, somewhere in a region, with late binding (Sparrow): the
submit puts it in the region's JetStream work-queue stream, and a worker takes it only when it has a
free slot. The record of each job (state, attempts, exit status, output) is a value of KV
`fauxmad_jobs`, written with compare-and-set by whoever moves it on, so a cancel and a worker never
overwrite each other. Since issue 44 the submit writes only the queue message (on
`fauxmad.v1.jobs.queue.<region>.<app>.<job id>`, an addition), which carries the job as submitted: the record's
first value is written by the worker that takes the job (or by a cancel of the queued job), and until then
status, list and wait answer from the queue. States: `queued` -> `running` -> `succeeded` | `failed` | `cancelled`, and
`running` -> `queued` again for a retry (a failure with attempts left, or a worker lost mid-task).

A job may name an image (`image`: `name:tag` or a digest, an optional field: a submit without it is
encoded as before, so older workers take it). The worker that answers the submit resolves it with
`bus.stores.images.resolve_image`, the resolver every door uses, and the record keeps the digest (and, when the
submit gave no `cmd`, the image's own command): every attempt, on whichever worker, runs those bytes.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated, Literal

import msgspec

from bus.contract.base import Cpus, MemoryMb, Reply, Request, Token

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
Runner = Literal["machine", "process"]

JobId = Annotated[str, msgspec.Meta(pattern=r"^j[0-9a-f]{15}$")]
OUTPUT_KEEP = 4096  # characters of stdout and of stderr kept in the record (the last ones)
MAX_COUNT = 10_000


def new_job_id() -> str:
    return "j" + secrets.token_hex(8)[:15]


def keyed_job_ids(app: str, key: str, count: int) -> list[str]:
    """The ids a keyed submit makes: the same key always names the same jobs (exactly-once submits)."""
    base = hashlib.sha256(f"{app}\0{key}".encode()).hexdigest()
    return ["j" + hashlib.sha256(f"{base}\0{n}".encode()).hexdigest()[:15] for n in range(count)]


class JobSubmitRequest(Request):
    """`fauxmad.v1.api.apps.<app>.jobs.submit.<region>`: `count` jobs running `cmd` (each its own id and record);
    with `image`, in that image, and with no `cmd`, its own command."""

    app: Token
    cmd: Annotated[list[str], msgspec.Meta(max_length=4096)] = []
    env: dict[str, str] = {}
    cpus: Cpus = 1
    memory_mb: MemoryMb = 256
    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 3600.0
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)] = 1
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # "machine" (default): each attempt is a machine on the worker that destroys itself when done;
    # "process": the worker's fast path, a plain child process of the worker (no machine record)
    runner: Runner = "machine"
    # addition: `name:tag` or `sha256:<hex>` of the fleet's image store; left out of the JSON when not given
    image: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if not self.cmd and self.image is msgspec.UNSET:
            raise ValueError("cmd is required (or an image whose manifest has a command)")
        if any("\0" in part for part in self.cmd):
            raise ValueError("cmd must not contain NUL bytes")
        if self.cmd and not self.cmd[0]:
            raise ValueError("cmd[0] must not be empty")
        for key in self.env:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"invalid env var name {key!r}")

    def fingerprint(self) -> str:
        """What makes two keyed submits the same request (the key itself aside)."""
        spec = msgspec.structs.replace(self, idempotency_key=None)
        return hashlib.sha256(msgspec.json.encode(spec)).hexdigest()[:16]


class JobIdRequest(Request):
    """`fauxmad.v1.api.apps.<app>.jobs.status` and `.cancel`: one job of the app (`app` must be the subject's)."""

    app: Token
    id: JobId


class JobListRequest(Request):
    """`fauxmad.v1.api.apps.<app>.jobs.list`: the app's jobs, newest first."""

    app: Token
    state: JobState | None = None
    region: Token | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 1000


class JobAttempt(Reply):
    attempt: int
    worker_id: str
    machine_id: str | None = None
    claimed_at: float = 0.0  # the worker took it from the queue (epoch seconds)
    started_at: float | None = None  # its process runs
    finished_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    outcome: str = "running"  # running, succeeded, failed, timed out, cancelled, lost (the worker died)


class Job(Reply):
    id: str
    app: str
    region: str
    state: JobState
    cmd: list[str]
    env: dict[str, str] = {}
    cpus: int = 1
    memory_mb: int = 256
    timeout: float = 3600.0
    max_attempts: int = 3
    runner: Runner = "machine"
    image: str | None = None  # the digest its attempts run in (the submit's `image`, resolved), or none
    attempt: int = 0  # the current (or last) attempt's number, from 1
    attempts: list[JobAttempt] = []
    submitted_at: float = 0.0
    claimed_at: float | None = None  # of the current attempt
    started_at: float | None = None
    finished_at: float | None = None
    retry_at: float | None = None  # a failed attempt's retry is not taken before this
    worker_id: str | None = None
    machine_id: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""  # the last OUTPUT_KEEP characters
    stderr: str = ""
    reason: str = ""  # why it is in its state, in words
    cancel_requested: bool = False
    dead_lettered: bool = False
    idempotency_key: str | None = None
    fingerprint: str = ""
    index: int = 0  # its place in its submit's `count`
    queue_seq: int = 0  # the work queue's message that holds it (0 until a worker first takes it)


class JobSubmitReply(Reply):
    jobs: list[Job]


class JobTask(Reply):
    """A message of the region's work-queue stream: which job to run (its record says how).

    `job` (an addition, left out of the JSON when not given): the record as submitted. Every submit's message
    carries it since issue 44, and no record is written at the submit: until a worker takes the job (and
    writes its record to KV `fauxmad_jobs` before acking the message), this is the job's record. A message
    without it (from an older worker, whose submit wrote the record) is read as before."""

    id: str
    app: str
    job: Job | msgspec.UnsetType = msgspec.UNSET


class JobEvent(Reply):
    """`fauxmad.v1.jobs.events.<region>.<app>.<job_id>`: a job changed state (stream `FAUXMAD_JOB_EVENTS`)."""

    id: str
    app: str
    region: str
    state: JobState
    attempt: int = 0
    worker_id: str | None = None
    machine_id: str | None = None
    exit_code: int | None = None
    reason: str = ""
    at: float = 0.0


# `fauxmad.v1.api.apps.<app>.jobs.<verb>` (any worker, queue group `jobs`) and `...jobs.submit.<region>` (that
# region's workers, queue group `jobs`): each verb's payload, listed once.
JOB_REQUESTS: dict[str, type[Request]] = {
    "submit": JobSubmitRequest,
    "status": JobIdRequest,
    "list": JobListRequest,
    "cancel": JobIdRequest,
}


def event_of(job: Job, at: float) -> JobEvent:
    return JobEvent(
        id=job.id,
        app=job.app,
        region=job.region,
        state=job.state,
        attempt=job.attempt,
        worker_id=job.worker_id,
        machine_id=job.machine_id,
        exit_code=job.exit_code,
        reason=job.reason,
        at=at,
    )


def retry_delay(attempt: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Seconds before a failed attempt `attempt` (from 1) is tried again: doubling from `base`, at most `cap`."""
    return float(min(cap, base * (2 ** max(0, attempt - 1))))
