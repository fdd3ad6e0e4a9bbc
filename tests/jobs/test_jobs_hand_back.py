"""A stopping worker hands the jobs it pulled but has not started back to the queue at once.

Real nats-server, the region's real work queue and consumer (ack wait 30 s), the worker's real `Puller` and
`JobRunner`; the job's record read never returns, so the attempt never begins. Closing the puller (what a
worker's SIGTERM does) naks the message without delay: another pull gets it again (delivered twice) well
within a second or two, not after the 30 s ack wait. The worker still has a pull request open for one more job:
a job arriving for it after the stop goes back at once too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, cast

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.jobs import JobTask
from bus.transport.jetstream import ensure_jobs_resources
from tests.helpers import arun, connect_nats, until
from workers.jobs.puller import Puller
from workers.jobs.runner import JobRunner

ACK_WAIT = 30.0


class NeverAnswers:
    """Job records whose read never returns: the attempt never begins (as when a worker stops meanwhile)."""

    def __init__(self) -> None:
        self.reads = 0

    async def read(self, app: str, job_id: str) -> Any:
        self.reads += 1
        await asyncio.Event().wait()


def test_jobs_pulled_but_not_started_go_back_at_once(nats_url: str, unique: Any) -> None:
    region = unique("handback")

    async def scenario() -> None:
        nc = await connect_nats(nats_url)
        try:
            js = nc.jetstream()
            queue = await ensure_jobs_resources(js, region, ack_wait=ACK_WAIT)
            records = NeverAnswers()
            runner = JobRunner(
                nc, cast(Any, records), {}, worker_id="w1", region=region, workers_kv=None, ack_wait=ACK_WAIT
            )
            puller = Puller(nc, queue.stream, subjects.JOBS_CONSUMER, slots=lambda: 2, handle=runner.handle)
            await puller.start()
            await js.publish(subjects.jobs_queue(region), encode(JobTask(id="job-1", app="a")))
            await until(lambda: _true(records.reads == 1 and puller.outstanding == 1), "the job pulled, one more asked")

            puller.stop_asking()  # the worker is stopping: a job arriving for the open request goes back too
            await js.publish(subjects.jobs_queue(region), encode(JobTask(id="job-2", app="a")))

            async def delivered() -> bool:  # to the one open pull request, the stopping worker's
                return (await js.consumer_info(queue.stream, subjects.JOBS_CONSUMER)).num_pending == 0

            await until(delivered, "job-2 delivered to the stopping worker's open pull request")
            stopped = time.monotonic()
            await puller.close()

            other = await js.pull_subscribe_bind(subjects.JOBS_CONSUMER, queue.stream)
            again: list[Any] = []
            # the fetches give up after 5 s, long before the 30 s ack wait: both jobs here were handed back (nak'd)
            while len(again) < 2 and time.monotonic() - stopped < 5.0:  # a fetch may return what is there first
                with contextlib.suppress(TimeoutError):
                    again += await other.fetch(2 - len(again), timeout=1)
            ids = sorted(msg.data for msg in again)
            assert ids == sorted([encode(JobTask(id="job-1", app="a")), encode(JobTask(id="job-2", app="a"))])
            assert all(msg.metadata.num_delivered >= 2 for msg in again), [m.metadata for m in again]
            for msg in again:
                await msg.ack()
        finally:
            await nc.close()

    arun(scenario())


async def _true(value: bool) -> bool:
    return value
