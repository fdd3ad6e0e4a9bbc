"""Prometheus metrics of the long-running processes: a real nats-server, a worker and a broker process
each with `--metrics-listen`, a create with a health check, then a scrape of each."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.contract.errors import NoCapacity, Unreachable
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Check, Guest, MachineConfig
from bus.local.embedded import EmbeddedNats
from orchestrator.client import FleetClient
from tests.helpers import ROOT, arun, until, wait_until
from tests.orchestrator.proxy_kit import free_port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def value(text: str, name: str) -> float:
    """The sample `name` (with its labels, exactly as exposed); 0 if absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def processes(fresh_nats: EmbeddedNats, tmp_path: Path) -> Iterator[tuple[str, int, int]]:
    worker_port, broker_port = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "orchestrator.cli"]
    url = fresh_nats.url
    procs = [
        subprocess.Popen(
            [
                *[*cli, "worker", "--nats", url, "--region", "met", "--worker-id", "met-w1", "--cpus", "4"],
                *["--memory-mb", "2048", "--data-dir", str(tmp_path / "w"), "--max-load", "0"],
                *["--metrics-listen", f"127.0.0.1:{worker_port}"],
            ],
            env=env,
        ),
        subprocess.Popen([*cli, "broker", "--nats", url, "--metrics-listen", f"127.0.0.1:{broker_port}"], env=env),
    ]
    try:
        deadline = time.monotonic() + 30
        for port in (worker_port, broker_port):
            while True:
                try:
                    scrape(port)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "no /metrics"
                    time.sleep(0.05)
        yield url, worker_port, broker_port
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(20)


def test_worker_and_broker_metrics_count_what_happened(processes: tuple[str, int, int]) -> None:
    url, worker_port, broker_port = processes
    check = Check(type="cmd", command=["true"], interval="100ms", timeout="1s")
    config = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=64), checks={"ok": check})

    async def main() -> None:
        client = await FleetClient.connect(url)
        try:
            deadline = time.monotonic() + 20
            while True:  # the broker subscribes (after /metrics is up), the worker's first heartbeat reaches it
                try:
                    machine = await client.create("met", CreateRequest(region="met", config=config))
                    break
                except (NoCapacity, Unreachable):
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            too_big = MachineConfig(cmd=["sleep", "1"], guest=Guest(cpus=64))
            with pytest.raises(NoCapacity):
                await client.create("met", CreateRequest(region="met", config=too_big))

            async def checked() -> bool:  # the checks run (every 100 ms) while the machine does
                return value(scrape(worker_port), 'fauxmad_worker_check_results_total{status="passing"}') >= 1

            await until(checked, "a passing check result")
            await client.stop("met", machine.id)
            await client.destroy("met", machine.id)
        finally:
            await client.close()

    arun(main())

    def counted_destroyed() -> str:  # the next heartbeat sets the state gauge, destroyed included
        text = scrape(worker_port)
        return text if 'fauxmad_worker_machines{state="destroyed"}' in text else ""

    worker = wait_until(counted_destroyed, "the worker's heartbeat counting the destroyed machine")
    assert value(worker, 'fauxmad_worker_requests_total{outcome="ok",verb="reserve"}') >= 1
    assert value(worker, 'fauxmad_worker_request_seconds_count{verb="reserve"}') >= 1
    assert value(worker, "fauxmad_worker_commits_total") >= 3
    assert value(worker, "fauxmad_worker_commit_batch_size_count") == value(worker, "fauxmad_worker_commits_total")
    assert value(worker, 'fauxmad_worker_check_results_total{status="passing"}') >= 1
    assert 'fauxmad_worker_machines{state="destroyed"}' in worker
    broker = scrape(broker_port)
    assert value(broker, 'fauxmad_broker_creates_total{outcome="placed",strategy="scatter"}') >= 1
    assert value(broker, 'fauxmad_broker_creates_total{outcome="503",strategy="scatter"}') >= 1
    assert value(broker, "fauxmad_broker_gather_asked_count") >= 1
    assert value(broker, 'fauxmad_broker_create_seconds_count{strategy="scatter"}') >= 1
