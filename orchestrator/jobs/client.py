"""A typed client for background jobs: one request per documented subject, plus `wait` on KV `fauxmad_jobs`.

`wait` watches the job records themselves (a KV watcher on `<app>.<id>` keys), so it learns of the end
of each job the moment it is written, without polling any worker. A queued job has no record until a worker
takes it (issue 44): a job the watch has no record of is asked of the desk (`status`, which reads the queue)
before it is called unknown, and its record comes through the same watch once it is taken. A caller that
has the jobs from their submit's answer says so (`submitted`): they exist, so nothing is asked (asking
cost a status request and four JetStream reads per job: in `bench jobs`, more than the jobs themselves).
"""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.errors import DeadlineExceeded, NoCapacity, NotFound, Unreachable
from bus.contract.jobs import TERMINAL, Job, JobIdRequest, JobListRequest, JobSubmitReply, JobSubmitRequest
from bus.stores.kv_watch import stop_watch
from bus.transport.connection import connect
from bus.transport.nats_adapter import KV, APIError, KeyNotFoundError, Nats
from bus.transport.service import call

SUBMIT_TIMEOUT = 30.0


def no_live_workers(region: str) -> str:
    """The one message for a region with no live workers, a job's as a machine's (the brokers' auction)."""
    return f"no capacity in {region}: no live workers in that region"


class JobHead(msgspec.Struct):
    """The two fields of a record `wait` looks at first."""

    id: str
    state: str


class JobsClient:
    def __init__(self, nc: Nats) -> None:
        self.nc = nc

    @classmethod
    async def connect(cls, url: str, name: str = "fauxmad-jobs") -> JobsClient:
        return cls(await connect(url, name))

    async def close(self) -> None:
        await self.nc.close()

    async def submit(self, region: str, request: JobSubmitRequest) -> list[Job]:
        """The jobs made; a region nobody serves is what a machine's create says of it: no capacity (503), no
        live workers there (a submit goes to the region's workers, so silence is exactly that)."""
        timeout = SUBMIT_TIMEOUT + request.count / 100
        try:
            reply = await call(
                self.nc, subjects.api_jobs_submit(request.app, region), request, JobSubmitReply, timeout=timeout
            )
        except Unreachable as exc:
            if type(exc) is not Unreachable:  # Unanswered: the request may have arrived, its outcome unknown
                raise
            raise NoCapacity(no_live_workers(region)) from None
        return reply.jobs

    async def status(self, app: str, job_id: str) -> Job:
        return await call(self.nc, subjects.api_jobs(app, "status"), JobIdRequest(app=app, id=job_id), Job)

    async def list(
        self, app: str, *, state: str | None = None, region: str | None = None, limit: int = 1000
    ) -> list[Job]:
        request = JobListRequest(app=app, state=state, region=region, limit=limit)  # type: ignore[arg-type]
        return await call(self.nc, subjects.api_jobs(app, "list"), request, list[Job], timeout=30.0)

    async def cancel(self, app: str, job_id: str) -> Job:
        return await call(self.nc, subjects.api_jobs(app, "cancel"), JobIdRequest(app=app, id=job_id), Job)

    async def _missing(self, kv: KV, app: str, job_ids: builtins.list[str]) -> builtins.list[str]:
        """Which of `job_ids` have no record, asked one by one. The watch's end-of-values marker alone cannot
        say: nats-py queues it first when the consumer reports nothing pending and its callback has received
        nothing yet, which is also the case when the server has already sent every record and the callback has
        not run (on a loaded host: a just-submitted batch then looked unknown, CI's `job wait` said not found)."""

        async def missing(job_id: str) -> bool:
            try:
                entry = await kv.get(subjects.job_key(app, job_id))
            except KeyNotFoundError:
                entry = None
            if entry is not None and entry.value:
                return False
            try:  # no record: a queued job has none until a worker takes it (the desk reads the queue)
                await self.status(app, job_id)
            except NotFound:
                return True
            return False

        found: builtins.list[str] = []
        for start in range(0, len(job_ids), 64):
            chunk = job_ids[start : start + 64]
            flags = await asyncio.gather(*(missing(job_id) for job_id in chunk))
            found += [job_id for job_id, gone in zip(chunk, flags, strict=True) if gone]
        return found

    async def wait(
        self, app: str, job_ids: builtins.list[str], timeout: float, *, submitted: bool = False
    ) -> dict[str, Job]:
        """Every job's record once it is succeeded, failed or cancelled; 504 when `timeout` passes first.
        `submitted`: the ids are from a submit's answer (the jobs exist), so one without a record is queued,
        not asked after; else such a job is asked of the desk, and one it does not know is a 404."""
        kv = await self.nc.jetstream().key_value(subjects.JOBS_BUCKET)
        wanted = set(job_ids)
        done: dict[str, Job] = {}
        keys = subjects.job_key(app, job_ids[0]) if len(job_ids) == 1 else f"{subjects.check_token('app', app)}.*"
        try:
            watcher: Any = await kv.watch(keys)
        except APIError as exc:  # e.g. the stream's consumers at their limit: said in words, never a traceback
            raise Unreachable(f"cannot watch the jobs' records now: {exc.description or exc!r}") from None
        seen: set[str] = set()
        try:
            async with asyncio.timeout(timeout):  # one deadline for the whole wait, not a timer per update
                async for entry in watcher:
                    if entry is None:  # the end of the records there were: a job with none does not exist
                        if submitted:
                            continue
                        unknown = await self._missing(kv, app, [job_id for job_id in job_ids if job_id not in seen])
                        if unknown:
                            raise NotFound(f"job {', '.join(unknown)} not found in app {app}")
                        continue
                    if not entry.value:
                        continue  # a delete
                    seen.add(entry.key.rsplit(".", 1)[-1])
                    head = decode(JobHead, entry.value)  # most updates are not an end: read the whole record once
                    if head.id in wanted and head.state in TERMINAL:
                        done[head.id] = decode(Job, entry.value)
                        if not wanted - done.keys():
                            break
        except TimeoutError:
            raise DeadlineExceeded(
                f"{len(wanted - done.keys())} of {len(wanted)} jobs not finished within {timeout:g}s"
            ) from None
        finally:
            await stop_watch(watcher)
        return done
