"""A fleet of hosts, as a team runs one (issue 40): nats-server, a broker, the operator and the edge proxy on host a,
a worker on each of hosts b, c and d, the CLI on the laptop (the root namespace). Nothing is shared through
loopback: each host is a network namespace with its own address (`orchestrator.devhosts`).

One fleet for the module (CI's time): the tests run in order and each leaves the app as it found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.contract.machines import Machine
from bus.transport.jetstream import WORKER_TTL
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.devhosts import unavailable
from tests.helpers import ROOT, arun, wait_until
from tests.orchestrator import proxy_kit as kit

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs hosts: {REASON}")

REGION = "hst"
APP = "spread"


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    spec = FleetSpec(regions=[REGION], workers_per_region=3, hosts=4, cpus=4, memory_mb=2048, operators=True)
    with DevFleet(spec) as running:
        yield running


def fauxmad(fleet: DevFleet, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI on the laptop: the root namespace, which reaches host a's nats-server over the bridge."""
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def listing(fleet: DevFleet, app: str) -> list[Machine]:
    async def run() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return [m for m in await client.list(app) if m.state not in ("destroying", "destroyed")]
        finally:
            await client.close()

    return arun(run())


def host_of(fleet: DevFleet, worker_id: str) -> str:
    return fleet.placement[f"worker-{worker_id}"].name


def netns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


def test_the_workers_are_ready_each_on_a_host_of_its_own(fleet: DevFleet) -> None:
    shown = fauxmad(fleet, "workers", "--json")
    assert shown.returncode == 0, shown.stderr
    workers = json.loads(shown.stdout)
    assert sorted(w["id"] if "id" in w else w["worker_id"] for w in workers) == ["hst-w1", "hst-w2", "hst-w3"]
    assert {host_of(fleet, w) for w in fleet.worker_ids} == {"b", "c", "d"}
    processes = dict(fleet.processes)
    for worker_id in fleet.worker_ids:
        assert netns_of(processes[f"worker-{worker_id}"].pid) == fleet.placement[f"worker-{worker_id}"].netns
    assert netns_of(processes["broker-1"].pid) == netns_of(processes["proxy"].pid) == fleet.placement["proxy"].netns


def test_deploy_lands_the_apps_machines_on_the_three_worker_hosts(fleet: DevFleet, tmp_path: Path) -> None:
    spec = tmp_path / "fauxmad.toml"
    spec.write_text(
        f'app = "{APP}"\ncmd = ["python3", "{kit.ECHO}"]\n[guest]\nmemory_mb = 64\n'
        f'[regions]\n{REGION} = 3\n[placement]\npreset = "spread"\n[http_service]\n'
    )
    done = fauxmad(fleet, "deploy", "-c", str(spec))
    assert done.returncode == 0, done.stdout + done.stderr
    machines = listing(fleet, APP)
    assert len(machines) == 3 and all(m.state == "started" for m in machines), machines
    assert sorted(host_of(fleet, m.worker_id) for m in machines) == ["b", "c", "d"]


def test_a_cut_hosts_machine_is_replaced_and_after_the_heal_one_copy_of_each_runs(fleet: DevFleet) -> None:
    assert fleet.hosts is not None
    before = listing(fleet, APP)
    (lost,) = [m for m in before if host_of(fleet, m.worker_id) == "b"]
    fleet.hosts.cut("b")
    try:

        def replaced() -> bool:
            others = [m for m in listing(fleet, APP) if m.worker_id != lost.worker_id and m.state == "started"]
            return len(others) >= 3

        wait_until(replaced, "the operator replaced host b's machine on hosts c and d", 4 * WORKER_TTL + 20, 0.5)
    finally:
        fleet.hosts.heal("b")

    def one_copy_each() -> bool:
        running = [m for m in listing(fleet, APP) if m.state == "started"]
        return len(running) == 3 and lost.id not in {m.id for m in running}

    wait_until(one_copy_each, "one running copy of each machine after the heal (b's old one retired)", 60, 0.5)
