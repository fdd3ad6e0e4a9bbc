"""Queued jobs, read from the work queues themselves: a job has no record until a worker takes it (issue 44).

A submit writes one thing per job, its message on `fauxmad.v1.jobs.queue.<region>.<app>.<job id>`, carrying
the job as submitted (`JobTask.job`); a worker writes the record (KV `fauxmad_jobs`) when it takes the job,
and acks the message only after that write. So a job is always in at least one of the two places, and who
reads both must read the queue first: a job taken between the two reads is then seen in the queue (its
message is there until after its record is written) or in the records, never in neither.

The queue is a work-queue stream: it allows no reading consumer beside the workers' own, so it is read
message by message (`$JS.API.STREAM.MSG.GET`, by subject): one request for a job, one per queued job of the
app for a list. The streams of every region are found by their subjects (`$JS.API.STREAM.NAMES`).
"""

from __future__ import annotations

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.errors import FauxmadError
from bus.contract.jobs import Job, JobTask
from bus.transport.jsfast import FastJetStream

LIST_MOST = 100_000  # queued messages read for one list, at most (the list's own limit is lower)


def _region_of(stream: str) -> str | None:
    if not stream.startswith(subjects.JOBS_STREAM_PREFIX):
        return None
    return stream[len(subjects.JOBS_STREAM_PREFIX) :] or None


def _job_of(data: bytes) -> Job | None:
    """The job a queue message carries as submitted, or None (a message of the older form: its record exists)."""
    try:
        task = decode(JobTask, data)
    except FauxmadError:
        return None
    job = task.job
    if isinstance(job, msgspec.UnsetType) or job.id != task.id or job.app != task.app:
        return None
    return job


class JobQueue:
    """The work queues' queued jobs, through one connection's `FastJetStream`."""

    def __init__(self, fast: FastJetStream) -> None:
        self.fast = fast

    async def regions(self) -> list[str]:
        """Every region that has a work queue."""
        names = await self.fast.stream_names(subjects.JOBS_QUEUES_ALL)
        return sorted(region for name in names if (region := _region_of(name)) is not None)

    async def find(self, app: str, job_id: str, region: str | None = None) -> Job | None:
        """Job `job_id` of `app` as submitted, if its message is still in a queue (of `region`, or of any)."""
        for where in [region] if region is not None else await self.regions():
            query = {"last_by_subj": subjects.jobs_queue_job(where, app, job_id)}
            message = await self.fast.get_message(subjects.jobs_stream(where), query)
            if message is not None and (job := _job_of(message.data)) is not None:
                return job
        return None

    async def queued(self, app: str | None, region: str | None = None, most: int = LIST_MOST) -> list[Job]:
        """Every job of `app` (None: of every app) whose message is in a queue (of `region`, or of any), oldest
        first per region, at most `most` in all."""
        jobs: list[Job] = []
        for where in [region] if region is not None else await self.regions():
            stream = subjects.jobs_stream(where)
            wanted = subjects.jobs_queue_app(where, app) if app is not None else subjects.jobs_queue_jobs(where)
            seq = 1
            while len(jobs) < most:
                message = await self.fast.get_message(stream, {"seq": seq, "next_by_subj": wanted})
                if message is None:
                    break
                seq = message.seq + 1
                if (job := _job_of(message.data)) is not None:
                    jobs.append(job)
        return jobs
