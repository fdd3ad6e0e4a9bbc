"""A job's queue message ahead of its record: asked for again on the documented schedule (2 ms, doubling), and
a keyless job's message carrying its record runs without it.

The pure parts: `take.record_wait` (the schedule) and `take.carried` (when a message's own record is trusted).
The real ones: a real nats-server, the region's real work queue and records bucket, the worker's real `Puller`,
`JobRunner` and `ProcessExecutor` (a real child process). What the runner tells the server is read on the wire
(a second connection subscribed to the stream's ack subjects), so the delay a nak asks for is checked as sent,
without timing anything: a runner that held such a message back 50 ms (the floor it had) fails here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.jobs import Job, JobTask, new_job_id
from bus.transport.jetstream import ensure_jobs_resources
from bus.transport.jsfast import FastJetStream, FastKV
from tests.helpers import arun, connect_nats, until
from workers.jobs.execute import ProcessExecutor, base_env
from workers.jobs.puller import Puller
from workers.jobs.reaper import Reaper
from workers.jobs.records import JobRecords
from workers.jobs.runner import JobRunner
from workers.jobs.take import CARRIED_FRESH, decide, record_wait

ACK_WAIT = 30.0


def queued(job_id: str, app: str, region: str, cmd: list[str]) -> Job:
    return Job(id=job_id, app=app, region=region, state="queued", cmd=cmd, runner="process", submitted_at=time.time())


def test_the_wait_for_a_record_starts_at_2_ms_and_doubles() -> None:
    assert [record_wait(n) for n in range(1, 10)] == [0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.25, 0.25]
    assert record_wait(10_000) == 0.25
    for deliveries in (1, 2, 3):
        take = decide(None, 7, 100.0, holder_alive=False, age=0.001, deliveries=deliveries)
        assert take.action == "later" and take.delay == record_wait(deliveries)


def test_a_message_trusts_its_carried_record_only_fresh_and_first() -> None:
    from workers.jobs.take import carried

    job = queued("j0123456789abcde", "a", "r", ["true"])
    task = JobTask(id=job.id, app="a", job=job)
    assert carried(task, age=0.001, deliveries=1) == job
    assert carried(task, age=CARRIED_FRESH, deliveries=1) is None  # it waited in the queue: a cancel may have come
    assert carried(task, age=-0.01, deliveries=1) == job  # clocks a little apart
    assert carried(task, age=-CARRIED_FRESH, deliveries=1) is None  # this host's clock far behind: age unknown
    assert carried(task, age=0.001, deliveries=2) is None  # a redelivery: the record decides
    assert carried(JobTask(id=job.id, app="a"), age=0.001, deliveries=1) is None  # nothing carried
    assert carried(JobTask(id="j0000000000000ff", app="a", job=job), age=0.001, deliveries=1) is None  # not its own


class Wire:
    """What the worker's connection tells the server about the queue's messages (acks, naks), as sent."""

    def __init__(self) -> None:
        self.said: list[tuple[int, bytes]] = []  # (the delivery it answers, from 1; the payload)

    async def on(self, msg: Any) -> None:
        tokens = msg.subject.split(".")
        if len(tokens) >= 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>
            self.said.append((int(tokens[4]), msg.data))

    def naks(self) -> list[tuple[int, float]]:
        """(delivery, the delay it asked for in seconds) of every nak seen."""
        found = []
        for delivered, data in self.said:
            if data.startswith(b"-NAK"):
                body = data[4:].strip()
                found.append((delivered, json.loads(body)["delay"] / 1e9 if body else 0.0))
        return found


def test_a_record_not_stored_yet_is_asked_for_on_the_schedule_then_run(nats_url: str, unique: Any) -> None:
    region, app = unique("early"), unique("app")

    async def scenario() -> None:
        nc = await connect_nats(nats_url)
        spy = await connect_nats(nats_url)
        reaper = Reaper()
        try:
            js = nc.jetstream()
            stream, records = await _queue(nc, region)
            wire = Wire()
            await _listening(nc, spy, f"$JS.ACK.{stream}", wire)
            puller = await _worker(nc, stream, records, reaper, region)
            job = queued(new_job_id(), app, region, ["true"])
            # a message without its record (an older submit's): the record comes only once it was asked for
            await js.publish(subjects.jobs_queue(region), encode(JobTask(id=job.id, app=app)))
            await until(lambda: _value(wire.naks()), "the worker naks the message whose record is missing")
            assert await records.create(job) is not None
            done = await until(lambda: _finished(records, app, job.id), "the job run once its record is there")
            assert done.state == "succeeded" and done.attempt == 1, done
            naks = wire.naks()
            assert all(delay == record_wait(delivered) for delivered, delay in naks), naks
            assert naks[0][1] <= record_wait(3), naks  # the first asked again after milliseconds, not 50
            await puller.close()
        finally:
            reaper.close()
            await spy.close()
            await nc.close()

    arun(scenario())


def test_a_carried_record_runs_before_its_record_is_written(nats_url: str, unique: Any, tmp_path: Path) -> None:
    """The submit's write of the record has not landed (here: never made): the worker runs the job from the
    record its message carries, and its one write creates the record. The submit's write coming after it finds
    the record there (the desk takes that as written)."""
    region, app = unique("carried"), unique("app")
    mark = tmp_path / "ran"

    async def scenario() -> None:
        nc = await connect_nats(nats_url)
        reaper = Reaper()
        try:
            js = nc.jetstream()
            stream, records = await _queue(nc, region)
            job = queued(new_job_id(), app, region, ["sh", "-c", f'echo "$FAUXMAD_JOB_ID" > {mark}'])
            assert await records.read(app, job.id) is None
            # fresh however slow the host is today: the path is what is tested
            puller = await _worker(nc, stream, records, reaper, region, carried_fresh=ACK_WAIT)
            await js.publish(subjects.jobs_queue(region), encode(JobTask(id=job.id, app=app, job=job)))
            done = await until(lambda: _finished(records, app, job.id), "the job run from its message")
            assert done.state == "succeeded" and done.attempt == 1 and done.worker_id == "w1", done
            assert mark.read_text().strip() == job.id
            assert await records.create(job) is None  # the submit's write, late: the record is the worker's
            assert (await records.get(app, job.id)).state == "succeeded"
            info = await js.consumer_info(stream, subjects.JOBS_CONSUMER)
            assert info.num_pending == 0 and info.num_ack_pending == 0, info  # acked: done with
            await puller.close()
        finally:
            reaper.close()
            await nc.close()

    arun(scenario())


async def _queue(nc: Any, region: str) -> tuple[str, JobRecords]:
    """The region's work queue (its stream's name) and the job records, as a worker has them."""
    resources = await ensure_jobs_resources(nc.jetstream(), region, ack_wait=ACK_WAIT)
    return resources.stream, JobRecords(resources.kv, FastKV(await FastJetStream(nc).start(), subjects.JOBS_BUCKET))


async def _worker(nc: Any, stream: str, records: JobRecords, reaper: Reaper, region: str, **options: Any) -> Puller:
    """A worker's jobs part, pulling: the real runner and process executor (2 slots)."""
    runner = JobRunner(
        nc,
        records,
        {"process": ProcessExecutor(base_env(), reaper)},
        worker_id="w1",
        region=region,
        workers_kv=None,
        ack_wait=ACK_WAIT,
        **options,
    )
    puller = Puller(nc, stream, subjects.JOBS_CONSUMER, slots=lambda: 2, handle=runner.handle)
    await puller.start()
    return puller


async def _listening(nc: Any, spy: Any, prefix: str, wire: Wire) -> None:
    """Subscribe `spy` to `prefix.>` and wait until it sees `nc`'s publishes (a SUB may take effect late)."""
    seen: list[bool] = []

    async def on(msg: Any) -> None:
        if msg.subject == f"{prefix}.probe":
            seen.append(True)
        else:
            await wire.on(msg)

    await spy.subscribe(f"{prefix}.>", cb=on)
    await spy.flush()

    async def probed() -> bool:
        await nc.publish(f"{prefix}.probe", b"")
        await nc.flush()
        return bool(seen)

    await until(probed, "the spy hears the worker's connection")


async def _value(value: Any) -> Any:
    return value


async def _finished(records: JobRecords, app: str, job_id: str) -> Job | None:
    found = await records.read(app, job_id)
    return found[0] if found and found[0].state in ("succeeded", "failed", "cancelled") else None
