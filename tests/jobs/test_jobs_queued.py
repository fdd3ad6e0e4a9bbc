"""Jobs without a record written at the submit (issue 44), with real nats-server and real worker processes: a
queued job lives only in its region's work queue, and status, list, wait and cancel find it there; a keyed
submit stays exactly once (the check of the queue and the records, and the queue's `Nats-Msg-Id` window); and
a worker killed -9 after taking jobs loses none of those acknowledged, records or not."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import KeyNotFoundError

from bus.contract import subjects
from bus.contract.errors import Conflict, DeadlineExceeded
from bus.contract.jobs import Job, JobSubmitRequest
from orchestrator.jobs.client import JobsClient
from tests.helpers import arun
from tests.jobs.kit import client


def appender(path: Path, then: str = "") -> list[str]:
    """A task that leaves one line per run: `<job id>:<attempt>`."""
    return ["sh", "-c", f'echo "$FAUXMAD_JOB_ID:$FAUXMAD_JOB_ATTEMPT" >> {path}{then}']


async def record(jobs: JobsClient, app: str, job_id: str) -> bytes | None:
    """The job's record in KV `fauxmad_jobs`, as stored (None: there is none)."""
    kv = await jobs.nc.jetstream().key_value(subjects.JOBS_BUCKET)
    try:
        entry = await kv.get(subjects.job_key(app, job_id))
    except KeyNotFoundError:
        return None
    return entry.value or None


async def queue_messages(jobs: JobsClient, region: str, app: str, job_id: str) -> int:
    """How many messages the region's work queue holds for the job."""
    info = await jobs.nc.jetstream().stream_info(
        subjects.jobs_stream(region), subjects_filter=subjects.jobs_queue_job(region, app, job_id)
    )
    return sum((info.state.subjects or {}).values())


async def until_state(jobs: JobsClient, app: str, job_id: str, state: str, timeout: float = 20.0) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await jobs.status(app, job_id)
        if job.state == state or time.monotonic() > deadline:
            return job
        await asyncio.sleep(0.05)


def test_a_queued_job_has_no_record_and_status_list_wait_and_cancel_find_it_in_the_queue(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=1)  # one slot: a long job holds it, what comes after waits in the queue
    runs = tmp_path / "runs.txt"

    async def scenario() -> dict[str, Any]:
        jobs = await client(nats_url)
        try:
            (blocker,) = await jobs.submit(region, JobSubmitRequest(app=app, cmd=["sleep", "60"], runner="process"))
            assert (await until_state(jobs, app, blocker.id, "running")).state == "running"
            (waiting, doomed) = await jobs.submit(
                region, JobSubmitRequest(app=app, cmd=appender(runs), count=2, runner="process")
            )
            seen: dict[str, Any] = {
                "record": await record(jobs, app, waiting.id),
                "status": await jobs.status(app, waiting.id),
                "listed": {job.id: job.state for job in await jobs.list(app)},
                "queued_only": {job.id for job in await jobs.list(app, state="queued")},
            }
            try:
                await jobs.wait(app, [waiting.id], 0.5)  # known (queued), so it waits: a 504, not a 404
            except DeadlineExceeded as exc:
                seen["wait"] = exc
            seen["cancelled"] = await jobs.cancel(app, doomed.id)
            await jobs.cancel(app, blocker.id)
            seen["done"] = await jobs.wait(app, [waiting.id, doomed.id, blocker.id], 30.0)
            seen["ids"] = (blocker.id, waiting.id, doomed.id)
            return seen
        finally:
            await jobs.close()

    seen = arun(scenario())
    blocker, waiting, doomed = seen["ids"]
    assert seen["record"] is None  # the submit wrote no record: the queue holds the job
    assert seen["status"].state == "queued" and seen["status"].id == waiting and seen["status"].region == region
    assert seen["listed"] == {blocker: "running", waiting: "queued", doomed: "queued"}
    assert seen["queued_only"] == {waiting, doomed}
    assert isinstance(seen.get("wait"), DeadlineExceeded)
    assert seen["cancelled"].state == "cancelled" and seen["cancelled"].attempt == 0
    done = seen["done"]
    assert (done[waiting].state, done[doomed].state, done[blocker].state) == ("succeeded", "cancelled", "cancelled")
    # a window for a cancelled job to run if it were going to: the time is the test
    time.sleep(0.3)
    assert [line.split(":")[0] for line in runs.read_text().split()] == [waiting]  # the cancelled one never ran


def test_a_wait_on_a_submits_jobs_asks_the_desk_nothing_for_the_queued_ones(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    """`wait(..., submitted=True)` (the bench's, `job submit --wait`'s) takes the jobs for existing: a queued one
    (no record yet) is not asked after with a status request each, as a wait on ids from elsewhere does."""
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=1)

    async def scenario() -> dict[str, Any]:
        jobs = await client(nats_url)
        asked: list[str] = []

        async def count(msg: Any) -> None:
            asked.append(msg.subject)

        watch = await jobs.nc.subscribe(subjects.api_jobs(app, "status"), cb=count)  # beside the desk's queue group
        try:
            (blocker,) = await jobs.submit(region, JobSubmitRequest(app=app, cmd=["sleep", "60"], runner="process"))
            await until_state(jobs, app, blocker.id, "running")
            queued = await jobs.submit(region, JobSubmitRequest(app=app, cmd=["true"], count=5, runner="process"))
            ids = [job.id for job in queued]
            seen: dict[str, Any] = {}
            before = len(asked)
            try:
                await jobs.wait(app, ids, 0.5, submitted=True)
            except DeadlineExceeded as exc:
                seen["submitted_wait"] = exc
            seen["asked_submitted"] = len(asked) - before
            before = len(asked)
            try:
                await jobs.wait(app, ids, 0.5)
            except DeadlineExceeded as exc:
                seen["wait"] = exc
            seen["asked"] = len(asked) - before
            await jobs.cancel(app, blocker.id)
            seen["states"] = {job.state for job in (await jobs.wait(app, ids, 30.0, submitted=True)).values()}
            return seen
        finally:
            await watch.unsubscribe()
            await jobs.close()

    seen = arun(scenario())
    assert isinstance(seen.get("submitted_wait"), DeadlineExceeded)
    assert seen["asked_submitted"] == 0
    assert isinstance(seen.get("wait"), DeadlineExceeded)
    assert seen["asked"] > 0  # the other wait asks after the queued jobs: what this test sees when one does
    assert seen["states"] == {"succeeded"}


def test_a_keyed_submit_is_exactly_once_without_a_record_at_the_submit(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=1)
    runs = tmp_path / "runs.txt"

    async def scenario() -> dict[str, Any]:
        jobs = await client(nats_url)
        try:
            (blocker,) = await jobs.submit(region, JobSubmitRequest(app=app, cmd=["sleep", "60"], runner="process"))
            await until_state(jobs, app, blocker.id, "running")
            request = JobSubmitRequest(app=app, cmd=appender(runs), count=2, idempotency_key="k1", runner="process")
            # twice at once (they race past the check together: the queue's Nats-Msg-Id window decides), then again
            first, second = await asyncio.gather(jobs.submit(region, request), jobs.submit(region, request))
            third = await jobs.submit(region, request)
            seen: dict[str, Any] = {
                "ids": [[job.id for job in answer] for answer in (first, second, third)],
                "records": [await record(jobs, app, job.id) for job in first],
                "messages": [await queue_messages(jobs, region, app, job.id) for job in first],
            }
            try:  # the same key for another request while its jobs are queued: 409
                await jobs.submit(region, msgspec.structs.replace(request, cmd=["true"]))
            except Conflict as exc:
                seen["conflict"] = exc
            await jobs.cancel(app, blocker.id)
            done = await jobs.wait(app, [job.id for job in first], 30.0)
            seen["states"] = {job.state for job in done.values()}
            again = await jobs.submit(region, request)  # after they ran: the same jobs, from their records
            seen["again"] = [(job.id, job.state) for job in again]
            return seen
        finally:
            await jobs.close()

    seen = arun(scenario())
    ids = seen["ids"][0]
    assert seen["ids"] == [ids, ids, ids] and len(set(ids)) == 2
    assert seen["records"] == [None, None]  # no record written by any of the three submits
    assert seen["messages"] == [1, 1]  # each job queued once
    assert isinstance(seen.get("conflict"), Conflict)
    assert seen["states"] == {"succeeded"}
    assert seen["again"] == [(job_id, "succeeded") for job_id in ids]
    # a window for a second run of a job to show up: the time is the test
    time.sleep(0.3)
    assert sorted(line.split(":")[0] for line in runs.read_text().split()) == sorted(ids)  # each ran once


def test_a_worker_killed_after_taking_jobs_loses_none_of_them(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The region's only worker takes jobs (some with a record, some not yet) and is killed -9: every job its
    submit acknowledged runs once a new worker comes, those it held and those still only in the queue."""
    region, app = unique("r"), unique("a")
    victim = worker_factory(region, cpus=2, extra=["--jobs-ack-wait", "2"])
    runs = tmp_path / "runs.txt"

    async def scenario() -> tuple[list[str], dict[str, Job]]:
        jobs = await client(nats_url)
        try:
            cmd = appender(runs, then="; sleep 0.5")
            submitted = await jobs.submit(region, JobSubmitRequest(app=app, cmd=cmd, count=12, runner="process"))
            deadline = time.monotonic() + 30
            while not (runs.exists() and runs.read_text().strip()) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            victim.kill9()  # type: ignore[attr-defined]
            await asyncio.to_thread(worker_factory, region, cpus=4, extra=["--jobs-ack-wait", "2"])  # it waits
            ids = [job.id for job in submitted]
            return ids, await jobs.wait(app, ids, 90.0)
        finally:
            await jobs.close()

    ids, done = arun(scenario())
    assert Counter(done[job_id].state for job_id in ids) == {"succeeded": 12}
    ran = Counter(line.split(":")[0] for line in runs.read_text().split())
    assert set(ran) == set(ids)  # none lost: those it held ran again, the queued ones ran
    killed = victim.worker_id  # type: ignore[attr-defined]
    assert all(done[job_id].worker_id != killed for job_id in ids)  # every success is the new worker's
