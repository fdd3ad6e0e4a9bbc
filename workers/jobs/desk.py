"""The job desk: `submit`, `status`, `list` and `cancel`, answered by workers (queue group `jobs`).

A submit reaches the workers of its region (`fauxmad.v1.api.apps.<app>.jobs.submit.<region>`); status,
list and cancel any worker (`fauxmad.v1.api.apps.<app>.jobs.<verb>`): the records are in KV
`fauxmad_jobs`, readable from anywhere. The payload's app must be the subject's. A submit stores each
job's record (`queued`) and publishes the job to the region's work queue, side by side for new ids (the
message then carries the record: a worker that gets it first runs from it), and answers only once
JetStream has acknowledged both: an answered submit is never lost. With an idempotency key the jobs'
ids come from the key, and the record's create is the claim: the same key again answers with the same
jobs (a different request under it is a 409), never runs them twice.

A submit that names an image is resolved here, before anything is written, with `bus.stores.images.resolve_image`
(the resolver every door uses): an unknown reference is a 400 naming it; the records keep the digest, and
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
from nats.aio.client import Client

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import BadRequest, Conflict, Unreachable
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
from bus.transport.jsfast import FastJetStream
from bus.transport.service import request
from workers.jobs import outcome as moves
from workers.jobs.records import JobRecords


class JobDesk:
    def __init__(
        self,
        nc: Client,
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

    async def _store(self, job: Job) -> tuple[Job, bool]:
        """(the record, whether it must be published): a keyed job already stored is published again only
        while no worker ever took it (the queue's `Nats-Msg-Id` de-duplicates a publish that did land)."""
        created = await self.records.create(job)
        if created is not None:
            return created, True
        existing = await self.records.get(job.app, job.id)
        if existing.fingerprint != job.fingerprint:
            raise Conflict(f"idempotency key {job.idempotency_key!r} was used for a different submit")
        return existing, existing.state == "queued" and existing.attempt == 0

    async def _publish(self, job: Job, carry: bool = False) -> None:
        """`carry`: the message carries the record as submitted (keyless jobs: a worker given it fresh runs it
        without reading the record, which is being written beside it)."""
        task = JobTask(id=job.id, app=job.app, job=job) if carry else JobTask(id=job.id, app=job.app)
        await self.fast.publish(subjects.jobs_queue(self.region), encode(task), headers={"Nats-Msg-Id": job.id})

    async def submit(self, subject: str, data: bytes) -> JobSubmitReply:
        req = same_app(subject, decode(JobSubmitRequest, data))
        jobs = self.new_jobs(req, *await self.pinned(req))
        self._answer_fits(jobs)
        # A job's `queued` event goes out before its queue message: once the message is out, a worker (this one,
        # even) may take the job and publish `running` first, and a reader of the events would see the job go
        # back to queued after it ran (the contract test saw running, succeeded, queued)
        if req.idempotency_key is None:
            # new ids: no record can be there, so the record and the message are written side by side, the
            # message carrying the record: a worker given it first runs from it, and writes the record itself if
            # it gets there before this write (workers/jobs/take.py, `carried`)
            for job in jobs:
                await self.emit(job)
            await asyncio.gather(*(self._create(job) for job in jobs), self._publish_all(jobs, carry=True))
            stored = [(job, True) for job in jobs]
        else:  # the record's create is the key's claim: it decides whether the jobs are published
            stored = list(await asyncio.gather(*(self._store(job) for job in jobs)))
            for job, published in stored:
                if published:
                    await self.emit(job)
            await self._publish_all([job for job, publish in stored if publish])
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

    async def _create(self, job: Job) -> None:
        """A keyless job's record. Already there: the worker its message reached first wrote it (a new id is
        random: 60 bits, never taken twice in practice)."""
        await self.records.create(job)

    async def _publish_all(self, jobs: list[Job], carry: bool = False) -> None:
        try:
            await asyncio.gather(*(self._publish(job, carry) for job in jobs))
        except Exception as exc:
            raise Unreachable(f"the work queue of {self.region} did not take the jobs: {exc!r}") from None

    async def status(self, subject: str, data: bytes) -> Job:
        req = same_app(subject, decode(JobIdRequest, data))
        return await self.records.get(req.app, req.id)

    async def list(self, subject: str, data: bytes) -> list[Job]:
        req = same_app(subject, decode(JobListRequest, data))
        jobs = [
            job
            for job in await self.records.list(req.app)
            if (req.state is None or job.state == req.state) and (req.region is None or job.region == req.region)
        ]
        jobs.sort(key=lambda job: (-job.submitted_at, job.index, job.id))
        return jobs[: req.limit]

    async def cancel(self, subject: str, data: bytes) -> Job:
        req = same_app(subject, decode(JobIdRequest, data))
        now = self.clock()
        job, changed = await self.records.change(req.app, req.id, lambda j: moves.cancel_requested(j, now=now))
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
