"""The job desk: `submit`, `status`, `list` and `cancel`, answered by workers (queue group `jobs`).

A submit reaches the workers of its region (`fauxmad.v1.api.apps.<app>.jobs.submit.<region>`); status,
list and cancel any worker (`fauxmad.v1.api.apps.<app>.jobs.<verb>`). The payload's app must be the
subject's. A submit makes one durable write per job (issue 44): its message on the region's work queue
(`fauxmad.v1.jobs.queue.<region>.<app>.<job id>`), carrying the job as submitted, and answers once
JetStream has acknowledged it: an answered submit is never lost. No record is written at the submit: the
worker that takes the job writes it (KV `fauxmad_jobs`) before it acks the message, so a job is always in
its queue or in the records, and status, list and cancel read the queue for a job with no record yet
(`bus.stores.job_queue`, queue first where both are read).

With an idempotency key the jobs' ids come from the key, and the same key again answers with the same jobs
(a different request under it is a 409), never runs them twice. Without a record written at the submit,
that is two things: a check before the publish (the job's message in the queue, then its record: in that
order, so a job taken meanwhile is seen in one of them), and the queue's `Nats-Msg-Id` de-duplication
(the job's id, within `JOBS_DUPLICATE_WINDOW`, 120 s) for two submits racing past the check together.

A submit that names an image is resolved here, before anything is written, with `bus.stores.images.resolve_image`
(the resolver every door uses): an unknown reference is a 400 naming it; the jobs keep the digest, and
the image's own command when the submit gave none. A keyed submit's fingerprint is of the request as sent,
so the same key and the same tag again answer with the jobs already pinned, even after the tag moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import BadRequest, Conflict, NotFound, Unreachable
from bus.contract.jobs import (
    Job,
    JobIdRequest,
    JobListRequest,
    JobSubmitReply,
    JobSubmitRequest,
    JobTask,
    keyed_job_ids,
    new_job_id,
)
from bus.stores.images import ImageError, Images, resolve_image
from bus.stores.job_queue import JobQueue
from bus.transport.jsfast import FastJetStream
from bus.transport.nats_adapter import Nats
from bus.transport.service import request
from workers.jobs import outcome as moves
from workers.jobs.records import JobRecords


class JobDesk:
    def __init__(
        self,
        nc: Nats,
        records: JobRecords,
        fast: FastJetStream,
        *,
        region: str,
        emit: Callable[[Job], Awaitable[None]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.nc = nc
        self.fast = fast
        self.records = records
        self.queue = JobQueue(fast)
        self.region = region
        self.emit = emit
        self.clock = clock
        self._images: Images | None = None  # bound on the first submit that names an image

    async def pinned(self, req: JobSubmitRequest) -> tuple[str | None, list[str]]:
        """(the digest its jobs run in, or None; the command they run): the submit's image resolved."""
        if req.image is msgspec.UNSET:
            return None, list(req.cmd)
        if self._images is None:
            self._images = await Images.open(self.nc.jetstream())
        try:
            image = await resolve_image(self._images, req.image)
        except ImageError as exc:
            raise BadRequest(f"image: {exc}") from None
        cmd = list(req.cmd) or image.cmd
        if not cmd:
            raise BadRequest(f"cmd is required: image {req.image} ({image.digest}) has no command of its own")
        return image.digest, cmd

    def new_jobs(self, req: JobSubmitRequest, image: str | None = None, cmd: list[str] | None = None) -> list[Job]:
        key = req.idempotency_key
        ids = keyed_job_ids(req.app, key, req.count) if key else [new_job_id() for _ in range(req.count)]
        now = self.clock()
        fingerprint = req.fingerprint()
        return [
            Job(
                id=job_id,
                app=req.app,
                region=self.region,
                state="queued",
                cmd=list(req.cmd) if cmd is None else cmd,
                image=image,
                env=dict(req.env),
                cpus=req.cpus,
                memory_mb=req.memory_mb,
                timeout=req.timeout,
                max_attempts=req.max_attempts,
                runner=req.runner,
                submitted_at=now,
                idempotency_key=key,
                fingerprint=fingerprint,
                index=index,
                reason="submitted",
            )
            for index, job_id in enumerate(ids)
        ]

    async def _existing(self, job: Job) -> Job | None:
        """The job already made under its key: its message in this region's queue, else its record (the queue
        first: a worker writes the record before it acks the message, so a job taken meanwhile is in one)."""
        queued = await self.queue.find(job.app, job.id, self.region)
        found = await self.records.read(job.app, job.id)
        if found is not None:
            return found[0]
        return queued

    def _same(self, job: Job, existing: Job) -> Job:
        if existing.fingerprint != job.fingerprint:
            raise Conflict(f"idempotency key {job.idempotency_key!r} was used for a different submit")
        return existing

    async def _keyed(self, job: Job) -> tuple[Job, bool]:
        """(the job, whether this submit queued it): a keyed job is queued once, whatever the submits."""
        existing = await self._existing(job)
        if existing is not None:
            return self._same(job, existing), False
        await self.emit(job)
        if not await self._publish(job):
            return job, True
        # a duplicate within the window: a submit racing this one queued it first
        existing = await self._existing(job)
        return (self._same(job, existing) if existing is not None else job), False

    async def _publish(self, job: Job) -> bool:
        """Put the job in the queue, carrying its record as submitted; True if the queue already had it (its
        `Nats-Msg-Id`, the job's id, seen within the duplicate window)."""
        task = JobTask(id=job.id, app=job.app, job=job)
        subject = subjects.jobs_queue_job(self.region, job.app, job.id)
        try:
            ack = await self.fast.publish_ack(subject, encode(task), headers={"Nats-Msg-Id": job.id})
        except Exception as exc:
            raise Unreachable(f"the work queue of {self.region} did not take the jobs: {exc!r}") from None
        return ack.duplicate

    async def submit(self, subject: str, data: bytes) -> JobSubmitReply:
        req = same_app(subject, decode(JobSubmitRequest, data))
        jobs = self.new_jobs(req, *await self.pinned(req))
        self._answer_fits(jobs)
        # A job's `queued` event goes out before its queue message: once the message is out, a worker (this one,
        # even) may take the job and publish `running` first, and a reader of the events would see the job go
        # back to queued after it ran (the contract test saw running, succeeded, queued)
        if req.idempotency_key is None:  # new ids: the queue message is the one write
            for job in jobs:
                await self.emit(job)
            await asyncio.gather(*(self._publish(job) for job in jobs))
            return JobSubmitReply(jobs=jobs)
        stored = await asyncio.gather(*(self._keyed(job) for job in jobs))
        return JobSubmitReply(jobs=[job for job, _ in stored])

    def _answer_fits(self, jobs: list[Job]) -> None:
        """Refuse, before anything is written, a submit whose answer (every job, in one NATS message) would not
        fit in the server's max_payload: the jobs would be queued and their submitter told nothing of them."""
        limit = int(self.nc.max_payload * 0.9)  # the jobs' records differ a little in size: a margin
        each = len(encode(jobs[0])) + 1
        if each * len(jobs) > limit:
            raise BadRequest(
                f"count {len(jobs)} is too many for one submit with this command and environment: the answer"
                f" lists every job (about {each * len(jobs)} bytes), over what one NATS message of this fleet"
                f" carries; submit at most {max(1, limit // each)} at a time"
            )

    async def status(self, subject: str, data: bytes) -> Job:
        req = same_app(subject, decode(JobIdRequest, data))
        found = await self.records.read(req.app, req.id)
        if found is not None:
            return found[0]
        queued = await self.queue.find(req.app, req.id)
        if queued is not None:
            return queued
        return await self.records.get(req.app, req.id)  # taken (and acked) between the two reads; else 404

    async def list(self, subject: str, data: bytes) -> list[Job]:
        req = same_app(subject, decode(JobListRequest, data))
        queued = await self.queue.queued(req.app, req.region)  # the queue first: see `_existing`
        by_id = {job.id: job for job in queued}
        by_id.update((job.id, job) for job in await self.records.list(req.app))
        jobs = [
            job
            for job in by_id.values()
            if (req.state is None or job.state == req.state) and (req.region is None or job.region == req.region)
        ]
        jobs.sort(key=lambda job: (-job.submitted_at, job.index, job.id))
        return jobs[: req.limit]

    async def cancel(self, subject: str, data: bytes) -> Job:
        req = same_app(subject, decode(JobIdRequest, data))
        now = self.clock()
        try:
            job, changed = await self.records.change(req.app, req.id, lambda j: moves.cancel_requested(j, now=now))
        except NotFound:  # no record: still queued (its first value is the cancel), or taken meanwhile, or none
            queued = await self.queue.find(req.app, req.id)
            job, changed = await self.records.change(
                req.app, req.id, lambda j: moves.cancel_requested(j, now=now), absent=queued
            )
        if changed:
            await self.emit(job)
        if job.state == "running" and job.worker_id:
            # the worker running it kills it and records `cancelled`; a gone worker's redelivery does
            with contextlib.suppress(Unreachable):
                await request(self.nc, subjects.worker_job_cancel(job.worker_id), encode(req), timeout=2.0)
            job = await self.records.get(req.app, req.id)
        return job


R = TypeVar("R", JobSubmitRequest, JobIdRequest, JobListRequest)


def same_app(subject: str, request: R) -> R:
    """The payload's app must be the subject's: permissions (a deployer's) are granted by subject."""
    named = subjects.parse_api_app(subject)
    if request.app != named:
        raise BadRequest(f"app {request.app!r} in the payload, but {named!r} in the subject")
    return request
