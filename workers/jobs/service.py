"""A worker's part in background jobs, wired: the desk's subscriptions, the runner, the puller.

The worker's free slots bound what it asks the queue for: at most `slots` jobs at a time (default: its
cpus), fewer while machines hold its cpus. Every job is counted as one slot; a job that needs more cpus
than are free when it arrives goes back to the queue (not an attempt) for another worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from bus.contract import subjects
from bus.contract.base import Ack
from bus.contract.codec import decode
from bus.contract.errors import NotFound
from bus.contract.jobs import JobIdRequest
from bus.transport.jetstream import JOBS_ACK_WAIT, ensure_jobs_resources
from bus.transport.jsfast import FastJetStream, FastKV
from bus.transport.nats_adapter import Bucket, Nats
from bus.transport.service import Responder
from workers.jobs.desk import JobDesk
from workers.jobs.execute import Executor, MachineExecutor, ProcessExecutor, base_env
from workers.jobs.puller import Puller
from workers.jobs.reaper import Reaper
from workers.jobs.records import JobRecords
from workers.jobs.runner import JobRunner
from workers.lifecycle.manager import MachineManager


class JobsService:
    def __init__(
        self,
        nc: Nats,
        manager: MachineManager,
        *,
        worker_id: str,
        region: str,
        slots: int,
        free_cpus: Callable[[], int],
        workers_kv: Bucket,
        ack_wait: float = JOBS_ACK_WAIT,
    ) -> None:
        self.nc = nc
        self.manager = manager
        self.worker_id = worker_id
        self.region = region
        self.max_slots = slots
        self.free_cpus = free_cpus
        self.workers_kv = workers_kv
        self.ack_wait = ack_wait
        self.subs: list[Any] = []
        self.puller: Puller | None = None
        self.runner: JobRunner | None = None
        self.reaper = Reaper()  # its watcher starts with the first `process` attempt

    def slots(self) -> int:
        """Jobs this worker may hold now: its slots, but no more than its cpus not held by other machines."""
        assert self.puller is not None
        held_by_jobs = self.puller.in_flight
        return max(0, min(self.max_slots, self.free_cpus() + held_by_jobs))

    async def start(self, responder: Responder) -> None:
        resources = await ensure_jobs_resources(self.nc.jetstream(), self.region, ack_wait=self.ack_wait)
        fast = await FastJetStream(self.nc).start()
        records = JobRecords(resources.kv, FastKV(fast, subjects.JOBS_BUCKET))
        executors: dict[str, Executor] = {
            "machine": MachineExecutor(self.manager, self.region),
            "process": ProcessExecutor(
                {**base_env(), "FAUXMAD_WORKER_ID": self.worker_id, "FAUXMAD_REGION": self.region},
                self.reaper,
                self.manager.images,  # the cache its machines use: an image job's files
            ),
        }
        self.runner = JobRunner(
            self.nc,
            records,
            executors,
            worker_id=self.worker_id,
            region=self.region,
            workers_kv=self.workers_kv,
            ack_wait=self.ack_wait,
        )
        desk = JobDesk(self.nc, records, fast, region=self.region, emit=self.runner.emit)
        routes = [
            (subjects.api_jobs_submit_wildcard(self.region), desk.submit),
            (subjects.api_jobs_wildcard("status"), desk.status),
            (subjects.api_jobs_wildcard("list"), desk.list),
            (subjects.api_jobs_wildcard("cancel"), desk.cancel),
        ]
        for subject, handler in routes:
            cb = responder.for_subscription(handler)
            self.subs.append(await self.nc.subscribe(subject, queue=subjects.JOBS_QUEUE, cb=cb))
        cancel_cb = responder.for_subscription(self._on_cancel, inline=True)
        self.subs.append(await self.nc.subscribe(subjects.worker_job_cancel(self.worker_id), cb=cancel_cb))
        self.puller = Puller(
            self.nc, resources.stream, subjects.JOBS_CONSUMER, slots=self.slots, handle=self.runner.handle
        )
        await self.puller.start()

    async def _on_cancel(self, subject: str, data: bytes) -> Ack:
        req = decode(JobIdRequest, data)
        assert self.runner is not None
        if not self.runner.cancel(req.id):
            raise NotFound(f"job {req.id} is not running on worker {self.worker_id}")
        return Ack(message=f"cancelling job {req.id}")

    def wake(self) -> None:
        """Capacity was freed (a machine went): ask the queue for more now."""
        if self.puller is not None:
            self.puller.wake()

    async def close(self) -> None:
        """Stop taking jobs: those pulled but not started go back to the queue at once (`Puller.close`)."""
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self.puller is not None:
            await self.puller.close()
        self.reaper.close()
