"""Background jobs with real nats-server and real worker processes: exactly once, kill -9, cancel,
retries and dead letters, idempotent submits, and 400s for bad submits."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec

from bus.contract import subjects
from bus.contract.errors import Conflict
from bus.contract.jobs import Job, JobSubmitRequest
from bus.contract.streams import AuditRecord
from tests.helpers import RawClient, arun, audit_records, connect_nats, until, wait_until
from tests.jobs.kit import client, overlapping, submit_and_wait

FAST_ACK_WAIT = ["--jobs-ack-wait", "2"]


def appender(path: Path) -> list[str]:
    """A task that leaves one line per run: `<job id>:<attempt>`."""
    return ["sh", "-c", f'echo "$FAUXMAD_JOB_ID:$FAUXMAD_JOB_ATTEMPT" >> {path}']


def test_a_thousand_short_tasks_complete_exactly_once(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    for _ in range(4):
        worker_factory(region, cpus=4)
    runs = tmp_path / "runs.txt"
    started = time.perf_counter()
    jobs = arun(submit_and_wait(nats_url, region, app=app, cmd=appender(runs), count=1000, runner="process"))
    took = time.perf_counter() - started
    assert Counter(job.state for job in jobs) == {"succeeded": 1000}
    assert all(job.attempt == 1 and len(job.attempts) == 1 for job in jobs)
    lines = runs.read_text().split()
    assert len(lines) == 1000 and {line.split(":")[0] for line in lines} == {job.id for job in jobs}
    assert len({job.worker_id for job in jobs}) == 4  # late binding spread them over the region
    print(f"1000 tasks in {took:.1f}s")


def test_a_job_runs_as_a_machine_that_destroys_itself(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    worker = worker_factory(region, cpus=2)
    jobs = arun(submit_and_wait(nats_url, region, app=app, cmd=["sh", "-c", "echo out; echo err >&2"], count=10))
    assert {job.state for job in jobs} == {"succeeded"}
    assert all(job.stdout == "out\n" and job.stderr == "err\n" and job.machine_id for job in jobs)

    async def machines() -> list[dict[str, object]]:
        nc = await connect_nats(nats_url)
        try:
            raw = RawClient(nc, worker.worker_id)  # type: ignore[attr-defined]
            for _ in range(100):  # the last one destroys itself just after its job is recorded
                listed = await raw.ok("list", {"app": app, "include_destroyed": True})
                if all(m["state"] == "destroyed" for m in listed):
                    return listed  # type: ignore[no-any-return]
                await asyncio.sleep(0.05)
            return listed  # type: ignore[no-any-return]
        finally:
            await nc.close()

    listed = arun(machines())
    assert {m["id"] for m in listed} == {job.machine_id for job in jobs}
    assert {m["state"] for m in listed} == {"destroyed"}
    assert all(m["config"]["metadata"]["fauxmad_job"] in {job.id for job in jobs} for m in listed)  # type: ignore[index]


def test_kill9_of_workers_mid_run_loses_none(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    workers = [worker_factory(region, cpus=4, extra=FAST_ACK_WAIT) for _ in range(4)]
    victims = {w.worker_id for w in workers[:2]}  # type: ignore[attr-defined]
    runs = tmp_path / "runs.txt"
    cmd = ["sh", "-c", f'sleep 0.3; echo "$FAUXMAD_JOB_ID:$FAUXMAD_JOB_ATTEMPT" >> {runs}']

    async def scenario() -> list[Job]:
        jobs = await client(nats_url)
        try:
            submitted = await jobs.submit(region, JobSubmitRequest(app=app, cmd=cmd, count=120, runner="process"))

            async def victims_mid_task() -> bool:
                running = await jobs.list(app, state="running")
                return victims <= {job.worker_id for job in running}

            # the victims must hold tasks when killed (a fixed sleep found them still starting under load)
            await until(victims_mid_task, "both victims running a task", 30, interval=0.05)
            for victim in workers[:2]:
                victim.kill9()  # type: ignore[attr-defined]
            # the ids are the submit's answer (`submitted`, as `job submit --wait` asks): without it, the wait asks
            # the desk after each job with no record yet, 64 at once, and a desk reads every region's queue for each
            # (the session's nats-server holds one per test that made a region): with two of the four desks just
            # killed, one such status took over its 5 s (CI60)
            done = await jobs.wait(app, [job.id for job in submitted], 90.0, submitted=True)
            return [done[job.id] for job in submitted]
        finally:
            await jobs.close()

    jobs = arun(scenario())
    assert Counter(job.state for job in jobs) == {"succeeded": 120}
    ran = Counter(line.split(":")[0] for line in runs.read_text().split())
    assert set(ran) == {job.id for job in jobs}  # none lost
    redelivered = [job for job in jobs if job.attempt > 1]
    assert redelivered, "the killed workers held tasks: they must have been run again"
    assert all(job.attempts[0].outcome == "lost" for job in redelivered)
    assert not any(overlapping(job) for job in jobs)  # never two attempts at once
    assert all(job.worker_id not in victims for job in redelivered)


def test_cancel_reaches_queued_and_running_jobs(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=1)

    async def scenario() -> tuple[Job, Job, list[dict[str, object]]]:
        jobs = await client(nats_url)
        try:
            first, second = await jobs.submit(region, JobSubmitRequest(app=app, cmd=["sleep", "60"], count=2))
            running = await _until(jobs, app, first.id, "running")  # one slot: the second waits in the queue
            assert running.machine_id or await _until_machine(jobs, app, first.id)
            queued = await jobs.status(app, second.id)
            assert queued.state == "queued"
            cancelled_queued = await jobs.cancel(app, second.id)
            await jobs.cancel(app, first.id)
            cancelled_running = (await jobs.wait(app, [first.id], 20.0))[first.id]
            raw = RawClient(jobs.nc, cancelled_running.worker_id or "")
            listed = await raw.ok("list", {"app": app, "include_destroyed": True})
            return cancelled_queued, cancelled_running, listed
        finally:
            await jobs.close()

    queued, running, machines = arun(scenario())
    assert queued.state == "cancelled" and queued.attempt == 0
    assert running.state == "cancelled" and running.attempts[-1].outcome == "cancelled"
    assert [m["state"] for m in machines] == ["destroyed"]  # the running attempt's machine was killed


async def _until(jobs: object, app: str, job_id: str, state: str, timeout: float = 20.0) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job: Job = await jobs.status(app, job_id)  # type: ignore[attr-defined]
        if job.state == state or time.monotonic() > deadline:
            return job
        await asyncio.sleep(0.05)


async def _until_machine(jobs: object, app: str, job_id: str) -> str | None:
    for _ in range(200):
        job: Job = await jobs.status(app, job_id)  # type: ignore[attr-defined]
        if job.machine_id:
            return job.machine_id
        await asyncio.sleep(0.05)
    return None


def test_failures_are_retried_with_backoff_then_dead_lettered(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=2)
    flaky = ["sh", "-c", 'test "$FAUXMAD_JOB_ATTEMPT" -ge 2']  # fails once, then succeeds
    recovered, dead = arun(
        _two(
            submit_and_wait(nats_url, region, app=app, cmd=flaky, max_attempts=3),
            submit_and_wait(nats_url, region, app=app, cmd=["sh", "-c", "echo no >&2; exit 3"], max_attempts=3),
        )
    )
    (job,) = recovered
    assert job.state == "succeeded" and job.attempt == 2
    assert [a.outcome for a in job.attempts] == ["failed", "succeeded"]
    (failed,) = dead
    assert failed.state == "failed" and failed.dead_lettered and failed.attempt == 3
    assert [a.exit_code for a in failed.attempts] == [3, 3, 3] and failed.stderr == "no\n"
    gaps = [b.claimed_at - (a.finished_at or 0) for a, b in zip(failed.attempts, failed.attempts[1:], strict=False)]
    assert gaps[0] >= 0.45 and gaps[1] >= 0.95  # back-off: 0.5 s, then 1 s

    async def dead_letter() -> Job:
        nc = await connect_nats(nats_url)
        try:
            js = nc.jetstream()
            msg = await js.get_last_msg(subjects.JOBS_DEAD_STREAM, subjects.jobs_dead(region, app))
            return msgspec.json.decode(msg.data, type=Job)
        finally:
            await nc.close()

    letter = arun(dead_letter())
    assert letter.id == failed.id and letter.state == "failed"


async def _two(a: object, b: object) -> tuple[list[Job], list[Job]]:
    return await asyncio.gather(a, b)  # type: ignore[return-value]


def test_an_idempotency_key_makes_a_submit_exactly_once(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=2)
    runs = tmp_path / "runs.txt"

    async def scenario() -> tuple[list[Job], list[Job], Exception | None]:
        jobs = await client(nats_url)
        try:
            request = JobSubmitRequest(app=app, cmd=appender(runs), count=3, idempotency_key="nightly-1")
            first = await jobs.submit(region, request)
            await jobs.wait(app, [job.id for job in first], 30.0)
            again = await jobs.submit(region, request)  # after they ran: the same jobs, not run again
            try:
                await jobs.submit(region, msgspec.structs.replace(request, cmd=["true"]))
            except Conflict as exc:
                return first, again, exc
            return first, again, None
        finally:
            await jobs.close()

    first, again, refused = arun(scenario())
    assert [job.id for job in again] == [job.id for job in first]
    assert {job.state for job in again} == {"succeeded"}
    assert refused is not None  # the same key for another request: 409
    # a window for a fourth run to show up if the key let one through: the time is the test
    time.sleep(0.5)
    assert len(runs.read_text().split()) == 3
    # each submit is in the audit trail, by the worker that answered it (an open fleet's clients: unsigned)
    recorded = [(r.path, r.identity, r.status) for r in arun(audit_records_at(nats_url, app))]
    submit = subjects.api_jobs_submit(app, region)
    assert recorded == [(submit, "unsigned", 200), (submit, "unsigned", 200), (submit, "unsigned", 409)]


async def audit_records_at(nats_url: str, app: str) -> list[AuditRecord]:
    nc = await connect_nats(nats_url)
    try:
        return await audit_records(nc, app)
    finally:
        await nc.close()


BAD_SUBMITS = [
    b"not json",
    b"{}",
    b'{"app": "a", "cmd": []}',
    b'{"app": "a", "cmd": ["true"], "count": 0}',
    b'{"app": "a b", "cmd": ["true"]}',
    b'{"app": "a", "cmd": ["true"], "max_attempts": 0}',
    b'{"app": "a", "cmd": ["true"], "timeout": -1}',
    b'{"app": "a", "cmd": ["true"], "runner": "vm"}',
    b'{"app": "a", "cmd": ["true"], "surprise": 1}',
    b'{"app": "a", "cmd": [""]}',
    b'{"app": "a", "cmd": ["true"], "count": 10001}',
    b"\xff\xfe",
    # valid, but its answer (every job, in one message) would be over the server's 1 MB max_payload
    b'{"app": "a", "cmd": ["sh", "-c", "' + b"x" * 2000 + b'"], "count": 1000}',
]


def test_bad_submits_are_400(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    region = unique("r")
    worker_factory(region, cpus=1)

    async def ask() -> list[tuple[str, dict[str, object]]]:
        nc = await connect_nats(nats_url)
        try:
            out = []
            asked = [(subjects.api_jobs_submit("a", region), payload) for payload in BAD_SUBMITS]
            asked += [
                (subject, payload)
                for payload in BAD_SUBMITS[:2]
                for subject in (subjects.api_jobs("a", "status"), subjects.api_jobs("a", "cancel"))
            ]
            asked += [
                (subjects.api_jobs("a", "status"), b'{"app": "a", "id": "j123"}'),
                (subjects.api_jobs("a", "list"), b'{"state": "x"}'),
                (subjects.api_jobs("a", "list"), b'{"app": "b"}'),  # another app than the subject's
                (subjects.api_jobs_submit("b", region), b'{"app": "a", "cmd": ["true"]}'),
            ]
            for subject, data in asked:
                msg = await nc.request(subject, data, timeout=5)
                out.append(((msg.headers or {}).get("Nats-Service-Error-Code", "200"), msgspec.json.decode(msg.data)))
            listed = await nc.request(subjects.api_jobs("a", "list"), b'{"app": "a"}', timeout=5)
            out.append(("jobs of app a", {"count": len(msgspec.json.decode(listed.data))}))
            unknown = await nc.request(
                subjects.api_jobs("a", "status"), b'{"app": "a", "id": "j00000000000000f"}', timeout=5
            )
            out.append(
                ((unknown.headers or {}).get("Nats-Service-Error-Code", "200"), msgspec.json.decode(unknown.data))
            )
            return out
        finally:
            await nc.close()

    *bad, unknown = arun(ask())
    *bad, (_, made) = bad
    assert made == {"count": 0}  # app a has no jobs at all: the refused submits wrote nothing
    for code, body in bad:
        assert code == "400", body
        assert body["error"]["code"] == 400  # type: ignore[index]
    assert unknown[0] == "404"


def test_cancel_and_timeout_kill_a_fast_path_process(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=2)

    async def scenario() -> tuple[Job, Job]:
        jobs = await client(nats_url)
        try:
            (slow,) = await jobs.submit(region, JobSubmitRequest(app=app, cmd=["sleep", "60"], runner="process"))
            request = JobSubmitRequest(app=app, cmd=["sleep", "60"], runner="process", timeout=0.5, max_attempts=1)
            (late,) = await jobs.submit(region, request)
            await _until(jobs, app, slow.id, "running")
            await jobs.cancel(app, slow.id)
            done = await jobs.wait(app, [slow.id, late.id], 20.0)
            return done[slow.id], done[late.id]
        finally:
            await jobs.close()

    # neither waited for its 60 s sleep: the slow one ended by the cancel's SIGKILL, the late one by its 0.5 s
    # timeout, as their records say (and `jobs.wait` gives up after 20 s, before either sleep could end)
    cancelled, timed_out = arun(scenario())
    assert cancelled.state == "cancelled" and cancelled.attempts[-1].signal == 9
    assert timed_out.state == "failed" and timed_out.reason.endswith("timed out after 0.5s: dead-lettered")


def test_a_worker_restarted_mid_task_gets_its_machine_job_run_again_after_the_fence(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    worker = worker_factory(region, cpus=1, extra=FAST_ACK_WAIT)
    runs = tmp_path / "runs.txt"
    cmd = [
        "sh",
        "-c",
        f'echo "start $FAUXMAD_JOB_ATTEMPT $(date +%s.%N)" >> {runs}; sleep 1; echo "end $FAUXMAD_JOB_ATTEMPT $(date +%s.%N)" >> {runs}',
    ]

    async def scenario() -> Job:
        jobs = await client(nats_url)
        try:
            (job,) = await jobs.submit(region, JobSubmitRequest(app=app, cmd=cmd, timeout=3.0))
            await _until(jobs, app, job.id, "running")
            await _until_machine(jobs, app, job.id)
            worker.kill9()  # type: ignore[attr-defined]
            await asyncio.to_thread(worker.start)  # type: ignore[attr-defined]  # the same id beats again, job forgotten
            return (await jobs.wait(app, [job.id], 60.0))[job.id]
        finally:
            await jobs.close()

    job = arun(scenario())
    assert job.state == "succeeded" and job.attempt == 2
    assert [a.outcome for a in job.attempts] == ["lost", "succeeded"]
    assert job.attempts[1].claimed_at >= job.attempts[0].claimed_at + 3.0 + 1.0  # the orphan's fence
    events = [line.split() for line in runs.read_text().splitlines()]
    spans = {attempt: [float(t) for kind, a, t in events if a == attempt] for attempt in ("1", "2")}
    assert len(spans["2"]) == 2 and (len(spans["1"]) < 2 or spans["1"][1] <= spans["2"][0])  # never at once


def test_a_fast_path_process_dies_with_its_worker_and_the_reaper_with_it(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    """A `process` attempt is the worker's child in a session of its own: kill -9 of the worker must end it
    (the worker's reaper sees its pipe close), or the redelivery would run beside it."""
    region, app = unique("r"), unique("a")
    victim = worker_factory(region, cpus=1)
    pid_file = tmp_path / "job.pid"
    cmd = ["sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"]

    async def start() -> None:
        jobs = await client(nats_url)
        try:
            await jobs.submit(region, JobSubmitRequest(app=app, cmd=cmd, runner="process"))
        finally:
            await jobs.close()

    arun(start())
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), "the job's pid file", 20)
    job_pid = int(pid_file.read_text())
    # the worker starts its reaper when it first watches a job, just after the job started (which may have written
    # its pid file already): two CI runs at two files at a time looked before it had, and found none
    reapers = wait_until(lambda: _reapers_of(victim.proc.pid), "the worker's job reaper", 10)  # type: ignore[attr-defined]
    assert len(reapers) == 1 and _alive(job_pid)
    victim.kill9()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 5
    while (_alive(job_pid) or any(_alive(r) for r in reapers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(job_pid), "the job outlived its worker"
    assert not any(_alive(r) for r in reapers), "the reaper outlived its worker"


def _alive(pid: int) -> bool:
    """Running (a zombie, waiting for whoever reaps it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _reapers_of(worker_pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == worker_pid and b"-S\0-c\0" in cmdline:
            found.append(int(entry.name))
    return found
