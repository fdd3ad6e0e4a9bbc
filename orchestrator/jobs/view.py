"""Jobs in the fleet's views: counts by app, region and state for `fauxmad status`, and the job events
history (stream `FAUXMAD_JOB_EVENTS`) for `fauxmad events --jobs`.

The counts are read from the records in KV `fauxmad_jobs` (one watcher over the app's keys, or all), not
from the machine view's SQLite file: a job's record is its truth, and each is one key. A queued job has no
record until a worker takes it (issue 44): those are counted from the work queues' per-subject counts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.errors import Forbidden
from bus.contract.jobs import Job, JobEvent
from bus.stores.kv_watch import current_values
from bus.transport.nats_adapter import BucketNotFoundError, Nats, NotFoundError
from orchestrator.view.history import replay


class JobCount(msgspec.Struct, frozen=True):
    app: str
    region: str
    state: str
    count: int


async def queued_in_queues(nc: Nats, app: str | None = None) -> dict[tuple[str, str], str]:
    """(app, job id) -> region of every job whose message is in a work queue (under its own subject: a
    submit's since issue 44), from the streams' per-subject counts: one request per region."""
    js = nc.jetstream()
    found: dict[tuple[str, str], str] = {}
    for stream in await js.streams_info():
        name = stream.config.name or ""
        if not name.startswith(subjects.JOBS_STREAM_PREFIX) or name == subjects.JOBS_DEAD_STREAM:
            continue  # the dead letters' stream shares the prefix and holds no queue
        region = name[len(subjects.JOBS_STREAM_PREFIX) :]
        wanted = subjects.jobs_queue_app(region, app) if app else f"{subjects.jobs_queue(region)}.*.*"
        try:
            info = await js.stream_info(name, subjects_filter=wanted)
        except NotFoundError:
            continue
        except Forbidden:
            # an app's deployer may not read the region's whole queue (other apps' job ids): its queued jobs
            # without a record yet are counted by `fauxmad job list`, which asks the region's workers
            continue
        for subject in info.state.subjects or {}:
            job_app, job_id = subject.rsplit(".", 2)[-2:]
            found[(job_app, job_id)] = region
    return found


async def job_counts(nc: Nats, app: str | None = None) -> list[JobCount]:
    """How many jobs each app has in each region and state (empty when no job was ever submitted). A job with
    no record yet is counted `queued` from its region's queue (read first: a job taken meanwhile has its
    record written before its message goes)."""
    queued = await queued_in_queues(nc, app)
    try:
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        return []
    counts: Counter[tuple[str, str, str]] = Counter()
    for entry in await current_values(kv, f"{subjects.check_token('app', app)}.*" if app else ">", timeout=30.0):
        if entry.value:
            job = decode(Job, entry.value)
            counts[(job.app, job.region, job.state)] += 1
            queued.pop((job.app, job.id), None)
    for (job_app, _), region in queued.items():
        counts[(job_app, region, "queued")] += 1
    return [JobCount(app=a, region=r, state=s, count=n) for (a, r, s), n in sorted(counts.items())]


async def read_job_events(
    nc: Nats, app: str | None, since: float | None, follow: bool, emit: Callable[[int, JobEvent], None]
) -> int:
    """Each job event (of `app`, or all), oldest first; see `orchestrator.view.history.replay`."""
    try:
        await nc.jetstream().stream_info(subjects.JOB_EVENTS_STREAM)
    except NotFoundError:
        return 0

    def handle(stream_seq: int, data: bytes) -> bool:
        try:
            event = decode(JobEvent, data)
        except Exception:
            return False  # a malformed publish is skipped, as in the machine events
        emit(stream_seq, event)
        return True

    return await replay(nc, subjects.JOB_EVENTS_STREAM, subjects.job_events_filter(app), since, follow, handle)
