"""The pure parts of jobs: what a worker does with a delivered message, and how a record moves on."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from bus.contract import subjects
from bus.contract.beats import WorkerBeats
from bus.contract.codec import encode
from bus.contract.fleet import WorkerInfo
from bus.contract.jobs import Job, keyed_job_ids, retry_delay
from bus.contract.offers import Resources
from tests.helpers import arun
from workers.jobs import outcome as moves
from workers.jobs.execute import Outcome
from workers.jobs.runner import JobRunner
from workers.jobs.take import decide


def job(**fields: object) -> Job:
    base: dict[str, object] = {"id": "j0123456789abcde", "app": "a", "region": "r", "state": "queued", "cmd": ["true"]}
    return Job(**{**base, **fields})  # type: ignore[arg-type]


def test_a_queued_job_runs_and_a_finished_one_is_dropped() -> None:
    assert decide(job(), 7, 100.0, holder_alive=False).action == "run"
    assert decide(job(state="succeeded", queue_seq=7), 7, 100.0, holder_alive=False).action == "drop"
    assert decide(None, 7, 100.0, holder_alive=False).action == "drop"
    # a message a moment ahead of its record (a submit writes both side by side): asked for again, sooner first
    first = decide(None, 7, 100.0, holder_alive=False, age=0.001, deliveries=1)
    again = decide(None, 7, 100.0, holder_alive=False, age=1.0, deliveries=6)
    assert first.action == again.action == "later" and 0 < first.delay < again.delay <= 0.25
    assert decide(None, 7, 100.0, holder_alive=False, age=31.0, deliveries=90).action == "drop"


def test_a_stray_copy_is_dropped_and_a_retry_waits_for_its_backoff() -> None:
    assert decide(job(queue_seq=3), 7, 100.0, holder_alive=False).action == "drop"
    later = decide(job(queue_seq=7, retry_at=102.0), 7, 100.0, holder_alive=False)
    assert later.action == "later" and later.delay == 2.0


def test_a_redelivery_waits_while_the_holder_lives_and_then_for_the_orphan_fence() -> None:
    held = job(state="running", queue_seq=7, worker_id="w1", claimed_at=90.0, timeout=20.0, attempt=1)
    assert decide(held, 7, 100.0, holder_alive=True).action == "later"
    fenced = decide(held, 7, 100.0, holder_alive=False)  # a machine may run until 90 + 20 + 1
    assert fenced.action == "later" and fenced.delay == 11.0
    taken = decide(held, 7, 112.0, holder_alive=False)
    assert taken.action == "run" and taken.lost_worker == "w1"
    process = job(state="running", queue_seq=7, worker_id="w1", claimed_at=90.0, runner="process", attempt=1)
    assert decide(process, 7, 100.0, holder_alive=False).action == "run"  # it died with its worker


def test_claims_count_attempts_and_mark_the_lost_one() -> None:
    first = moves.claimed(job(), worker_id="w1", seq=7, now=1.0, lost_worker=None)
    assert first is not None and first.attempt == 1 and first.state == "running"
    assert moves.claimed(first, worker_id="w2", seq=7, now=2.0, lost_worker=None) is None  # held by w1
    second = moves.claimed(first, worker_id="w2", seq=7, now=9.0, lost_worker="w1")
    assert second is not None and second.attempt == 2
    assert [a.outcome for a in second.attempts] == ["lost", "running"]


def test_failures_retry_with_backoff_then_dead_letter() -> None:
    running = moves.claimed(job(max_attempts=2), worker_id="w1", seq=7, now=1.0, lost_worker=None)
    assert running is not None
    retry = moves.finished(running, worker_id="w1", attempt=1, outcome=Outcome(exit_code=3), now=2.0)
    assert retry is not None and retry.state == "queued" and retry.retry_at == 2.0 + retry_delay(1)
    again = moves.claimed(retry, worker_id="w2", seq=7, now=3.0, lost_worker=None)
    assert again is not None
    dead = moves.finished(again, worker_id="w2", attempt=2, outcome=Outcome(exit_code=3), now=4.0)
    assert dead is not None and dead.state == "failed" and dead.dead_lettered
    assert moves.finished(dead, worker_id="w2", attempt=2, outcome=Outcome(exit_code=0), now=5.0) is None


def test_cancel_of_a_queued_job_is_at_once_and_of_a_running_one_a_request() -> None:
    assert moves.cancel_requested(job(), now=1.0).state == "cancelled"  # type: ignore[union-attr]
    marked = moves.cancel_requested(job(state="running", worker_id="w1"), now=1.0)
    assert marked is not None and marked.state == "running" and marked.cancel_requested


def test_keyed_ids_are_stable_and_distinct() -> None:
    ids = keyed_job_ids("a", "k", 3)
    assert ids == keyed_job_ids("a", "k", 3) and len(set(ids)) == 3
    assert ids != keyed_job_ids("b", "k", 3)
    assert retry_delay(1) == 0.5 and retry_delay(3) == 2.0 and retry_delay(30) == 30.0


def test_a_spec_jobs_table_gives_defaults_and_options_win() -> None:
    import pytest

    from orchestrator.apps.spec import SpecError, parse_spec
    from orchestrator.jobs.spec import SubmitOptions, submit_request

    spec = parse_spec(
        'app = "thumbs"\ncmd = ["serve"]\nenv = {A = "1"}\n[regions]\nmad = 1\n'
        '[jobs]\nregion = "mad"\ncmd = ["python3", "thumb.py"]\ntimeout = "10m"\nmax_attempts = 5\nrunner = "process"\n'
    )
    region, request = submit_request(SubmitOptions(count=2), spec)
    assert region == "mad" and request.app == "thumbs" and request.cmd == ["python3", "thumb.py"]
    assert request.timeout == 600.0 and request.max_attempts == 5 and request.runner == "process"
    assert request.env == {"A": "1"} and request.count == 2
    region, request = submit_request(SubmitOptions(region="syd", cmd=["true"], max_attempts=1, env={"A": "2"}), spec)
    assert region == "syd" and request.cmd == ["true"] and request.max_attempts == 1 and request.env == {"A": "2"}
    with pytest.raises(ValueError, match="no region"):
        submit_request(SubmitOptions(app="x", cmd=["true"]), None)
    with pytest.raises(SpecError, match=r"jobs\.retries"):
        parse_spec('app = "a"\ncmd = ["x"]\n[regions]\nmad = 1\n[jobs]\nretries = 3\n')


def test_a_short_attempt_is_claimed_and_finished_in_one_write_unless_the_record_moved_on() -> None:
    queued = job()

    def claim(j: Job) -> Job | None:
        return moves.claimed(j, worker_id="w1", seq=7, now=1.0, lost_worker=None)

    done = moves.settled(queued, claim=claim, worker_id="w1", attempt=1, outcome=Outcome(exit_code=0), now=2.0)
    assert done is not None and done.state == "succeeded" and done.queue_seq == 7
    assert [(a.attempt, a.worker_id, a.claimed_at, a.outcome) for a in done.attempts] == [(1, "w1", 1.0, "succeeded")]
    # its claim was written meanwhile (it ran past CLAIM_AFTER): finished from there, not claimed twice
    running = claim(queued)
    assert running is not None
    again = moves.settled(running, claim=None, worker_id="w1", attempt=1, outcome=Outcome(exit_code=0), now=2.0)
    assert again is not None and len(again.attempts) == 1 and again.state == "succeeded"
    # cancelled before the claim was written: the outcome is dropped
    cancelled = moves.cancel_requested(queued, now=1.5)
    assert cancelled is not None
    assert (
        moves.settled(cancelled, claim=claim, worker_id="w1", attempt=1, outcome=Outcome(exit_code=0), now=2.0) is None
    )


def test_a_message_carries_its_record_until_a_worker_writes_one() -> None:
    """Issue 44: no record is written at the submit, so a message with none found runs from the job it carries,
    however old, whoever delivers it (`take.as_submitted`), unless it is not its own or not as submitted."""
    import msgspec

    from bus.contract.jobs import Job, JobTask
    from workers.jobs.take import as_submitted, decide

    job = Job(id="j0123456789abcde", app="a", region="r", state="queued", cmd=["true"], runner="process")
    task = JobTask(id=job.id, app="a", job=job)
    assert as_submitted(task) == job
    assert decide(as_submitted(task), 7, 100.0, holder_alive=False, age=3600.0, deliveries=5).action == "run"
    assert as_submitted(JobTask(id=job.id, app="a")) is None  # an older submit's: its record decides
    assert as_submitted(JobTask(id=job.id, app="b", job=job)) is None  # not its own
    assert as_submitted(JobTask(id=job.id, app="a", job=msgspec.structs.replace(job, attempt=1))) is None
    assert as_submitted(JobTask(id=job.id, app="a", job=msgspec.structs.replace(job, state="running"))) is None


def test_the_holder_of_a_job_is_found_under_its_own_key_or_in_its_process_beat_group() -> None:
    """A redelivered job waits while its holder beats: a worker of its own beats its key; a process of logical
    workers beats one group key, named after its first worker, which is the one that takes the process's jobs."""

    def info(worker_id: str, started_at: float) -> bytes:
        return encode(
            WorkerInfo(
                worker_id=worker_id, region="r", capacity=Resources(1, 64), used=Resources(), started_at=started_at
            )
        )

    stored = {
        subjects.worker_key("r", "alone"): info("alone", 10.0),
        subjects.group_key("r", "g-0000"): encode(WorkerBeats(beats={"g-0000": msgspec.Raw(info("g-0000", 10.0))})),
    }

    class Bucket:
        async def get(self, key: str) -> SimpleNamespace:
            if key not in stored:
                raise KeyError(key)  # nats-py raises its KeyNotFoundError
            return SimpleNamespace(value=stored[key])

    class Nc:
        def jetstream(self) -> None:
            return None

    runner = JobRunner(Nc(), None, {}, worker_id="me", region="r", workers_kv=Bucket(), ack_wait=1.0)  # type: ignore[arg-type]

    def alive(worker_id: str, claimed_at: float = 20.0) -> bool:
        held = job(state="running", worker_id=worker_id, claimed_at=claimed_at)
        return arun(runner._holder_alive(held))

    assert alive("alone") and alive("g-0000")
    assert not alive("g-0001")  # not in any key: gone
    assert not alive("g-0000", claimed_at=5.0)  # its process started after it claimed the job: it forgot it
