"""Helpers for the job tests: a client on the test's nats-server, and what the records say."""

from __future__ import annotations

import itertools
from typing import Any

from bus.contract.jobs import Job, JobSubmitRequest
from orchestrator.jobs.client import JobsClient
from tests.helpers import connect_nats


async def client(url: str) -> JobsClient:
    return JobsClient(await connect_nats(url))


async def submit_and_wait(url: str, region: str, timeout: float = 120.0, **fields: Any) -> list[Job]:
    jobs = await client(url)
    try:
        submitted = await jobs.submit(region, JobSubmitRequest(**fields))
        done = await jobs.wait(fields["app"], [job.id for job in submitted], timeout, submitted=True)
        return [done[job.id] for job in submitted]
    finally:
        await jobs.close()


def overlapping(job: Job) -> bool:
    """Two attempts of the job whose runs overlapped in time (never allowed)."""
    spans = sorted((a.claimed_at, a.finished_at or float("inf")) for a in job.attempts)
    return any(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))
