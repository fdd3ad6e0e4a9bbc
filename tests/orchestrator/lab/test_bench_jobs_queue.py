"""`fauxmad bench jobs`' JetStream queue: the floor under fauxmad's queue, run for real (nats-server, worker
processes, `true` run as children): every job submitted comes back with its worker's record. No timing is
asserted."""

from __future__ import annotations

from lab.bench.jobs import JobsBenchOptions, measure_jetstream


def test_a_tiny_run_of_the_jetstream_queue_runs_every_job() -> None:
    options = JobsBenchOptions(tasks=6, samples=2, workers=2, slots=2, timeout=30.0)
    result = measure_jetstream(options, lambda line: None)
    assert result.system == "JetStream queue (plain nats-py)"
    assert result.tasks == 6 and result.tasks_per_s > 0
    assert result.free_taken.count == result.free_running.count == 2
    assert result.burst_taken.count == 6
    assert result.free_running.p50_ms >= result.free_taken.p50_ms >= 0
