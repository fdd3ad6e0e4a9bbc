"""A fleet of hosts, as a team runs one (issue 40): nats-server, a broker, the operator and the edge proxy on host a,
a worker on each of hosts b, c and d, the CLI on the laptop (the root namespace). Nothing is shared through
loopback: each host is a network namespace with its own address (`orchestrator.devhosts`).

One fleet for the module (CI's time): the tests run in order and each leaves the app as it found it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.contract.machines import Machine
from bus.transport.jetstream import WORKER_TTL
from lab.bench.http_client import Client
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.devhosts import unavailable
from tests.helpers import ROOT, arun, fleet_fixture, until, wait_until
from tests.helpers import fauxmad as run_fauxmad
from tests.orchestrator import proxy_kit as kit

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs hosts: {REASON}")

REGION = "hst"
APP = "spread"
# The promise (issue 40, docs/explanation/architecture.md "An unreachable host is noticed as fast as a dead
# machine"): the edge notices a cut host within 2 s (a ping every 0.5 s while requests are in flight, 0.75 s for
# its answer), and from then on every request answers 200 from the machines left. MARGIN is what a loaded 2-core
# box may add to the edge's own timers (its event loop shares the box with the fleet, the load and CI): a
# request sent NOTICE + MARGIN after the cut must never wait for host b.
NOTICE = 2.0
MARGIN = 0.5


fleet = fleet_fixture(
    FleetSpec(regions=[REGION], workers_per_region=3, hosts=4, cpus=4, memory_mb=2048, deadline_ms=1000)
)


def fauxmad(fleet: DevFleet, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI on the laptop: the root namespace, which reaches host a's nats-server over the bridge."""
    return run_fauxmad(*args, url=fleet.url, columns=200, timeout=120)


async def alisting(fleet: DevFleet, app: str) -> list[Machine]:
    client = await FleetClient.connect(fleet.url)
    try:
        return [m for m in await client.list(app) if m.state not in ("destroying", "destroyed")]
    finally:
        await client.close()


def listing(fleet: DevFleet, app: str) -> list[Machine]:
    return arun(alisting(fleet, app))


def host_of(fleet: DevFleet, worker_id: str) -> str:
    return fleet.placement[f"worker-{worker_id}"].name


def netns_of(pid: int) -> str:
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()


def edge(fleet: DevFleet) -> tuple[str, int]:
    assert fleet.edge is not None
    host, port = fleet.edge.rsplit(":", 1)
    return host, int(port)


async def get(fleet: DevFleet, app: str, limit: float = 15.0) -> tuple[int, str]:
    """One request through the edge on host a: (status, the machine that answered); 0 when none within `limit`."""
    address, port = edge(fleet)
    client = Client(port, address)
    try:
        response = await asyncio.wait_for(client.request(f"{app}.localhost"), limit)
        return response.status, response.headers.get("fauxmad-machine", "")
    except (TimeoutError, OSError):
        return 0, ""
    finally:
        await client.close()


def deploy(fleet: DevFleet, tmp_path: Path, app: str, rest: str) -> None:
    spec = tmp_path / f"{app}.toml"
    spec.write_text(f'app = "{app}"\ncmd = ["python3", "{kit.ECHO}"]\n[guest]\nmemory_mb = 64\n{rest}')
    done = fauxmad(fleet, "deploy", "-c", str(spec))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_workers_are_ready_each_on_a_host_of_its_own(fleet: DevFleet) -> None:
    shown = fauxmad(fleet, "workers", "--json")
    assert shown.returncode == 0, shown.stderr
    workers = json.loads(shown.stdout)
    assert sorted(w["id"] if "id" in w else w["worker_id"] for w in workers) == ["hst-w1", "hst-w2", "hst-w3"]
    assert {host_of(fleet, w) for w in fleet.worker_ids} == {"b", "c", "d"}
    for worker in workers:  # each advertises its own host's address (the local one of its NATS connection)
        worker_id = worker.get("id") or worker["worker_id"]
        assert worker["address"] == fleet.placement[f"worker-{worker_id}"].address, worker
    processes = dict(fleet.processes)
    for worker_id in fleet.worker_ids:
        assert netns_of(processes[f"worker-{worker_id}"].pid) == fleet.placement[f"worker-{worker_id}"].netns
    assert netns_of(processes["broker-1"].pid) == netns_of(processes["proxy"].pid) == fleet.placement["proxy"].netns


def test_deploy_lands_the_apps_machines_on_the_three_worker_hosts(fleet: DevFleet, tmp_path: Path) -> None:
    # preset spread: the default curves may put two of three on one worker
    deploy(fleet, tmp_path, APP, f'[regions]\n{REGION} = 3\n[placement]\npreset = "spread"\n[http_service]\n')
    machines = listing(fleet, APP)
    assert len(machines) == 3 and all(m.state == "started" for m in machines), machines
    assert sorted(host_of(fleet, m.worker_id) for m in machines) == ["b", "c", "d"]
    shown = fauxmad(fleet, "machine", "list", "--app", APP, "--json")
    assert shown.returncode == 0, shown.stderr
    for machine in json.loads(shown.stdout):
        assert machine["address"] == fleet.placement[f"worker-{machine['worker_id']}"].address, machine


def test_through_the_edge_on_host_a_every_request_answers_200(fleet: DevFleet) -> None:
    async def run() -> list[tuple[int, str]]:
        return [await get(fleet, APP) for _ in range(30)]

    answers = arun(run())
    assert {status for status, _ in answers} == {200}, answers
    assert {machine for _, machine in answers} <= {m.id for m in listing(fleet, APP)}


class Load:
    """Requests through the edge, four streams of one after another (a request held up on the cut host holds up
    only its own stream), each with when it was sent and how it was answered."""

    def __init__(self, fleet: DevFleet) -> None:
        self.fleet = fleet
        self.answers: list[tuple[float, int, str]] = []
        self.running = True

    async def run(self) -> None:
        await asyncio.gather(*(self.stream() for _ in range(4)))

    async def stream(self) -> None:
        while self.running:
            sent = time.monotonic()
            status, machine = await get(self.fleet, APP)
            self.answers.append((sent, status, machine))
            await asyncio.sleep(0.02)

    def since(self, moment: float) -> list[tuple[float, int, str]]:
        return [answer for answer in self.answers if answer[0] >= moment]


def test_host_bs_link_cut_under_load_the_edge_serves_from_the_others_and_one_copy_each_after_the_heal(
    fleet: DevFleet,
) -> None:
    assert fleet.hosts is not None
    (lost,) = [m for m in listing(fleet, APP) if host_of(fleet, m.worker_id) == "b"]
    load = Load(fleet)
    # the operator on the laptop from here on (not with the fleet: its passes raced the deploy's creates, and two of
    # three machines once landed on one host)
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT))
    operator = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "reconcile", "--watch"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def run() -> tuple[float, float]:
        assert fleet.hosts is not None
        traffic = asyncio.create_task(load.run())
        try:
            # traffic flowing before the cut, so the cut lands under load
            await asyncio.sleep(1.0)
            cut = time.monotonic()
            fleet.hosts.cut("b")

            async def replaced() -> bool:
                others = [
                    m for m in await alisting(fleet, APP) if m.worker_id != lost.worker_id and m.state == "started"
                ]
                return len(others) >= 3

            try:
                await until(replaced, "the operator replaced host b's machine on hosts c and d", 4 * WORKER_TTL + 20)
            finally:
                fleet.hosts.heal("b")
            healed = time.monotonic()

            async def one_copy_each() -> bool:
                running = [m for m in await alisting(fleet, APP) if m.state == "started"]
                return len(running) == 3 and lost.id not in {m.id for m in running}

            await until(one_copy_each, "one running copy of each machine after the heal (b's old one retired)", 60)
            # traffic on after the heal for a second more: what it sends then is checked too
            await asyncio.sleep(1.0)
            return cut, healed
        finally:
            load.running = False
            await traffic

    try:
        cut, healed = arun(run())
    finally:
        operator.terminate()
        operator.wait(10)
    assert lost.id in {machine for sent, _, machine in load.answers if sent < cut}, "b's machine served nothing before"
    # the requests sent between the cut and the heal that failed or were answered from b: none may come later than
    # the promise (the edge fails a request over to another machine, so there are usually none at all)
    answered = sorted(a for a in load.since(cut) if a[0] < healed)
    bad = [sent for sent, status, machine in answered if status != 200 or machine == lost.id]
    noticed = (max(bad) - cut) if bad else 0.0
    print(
        f"\n{len(answered)} requests between host b's cut and its heal; {len(bad)} failed or came from b"
        + (f", the last sent {noticed:.2f}s after the cut" if bad else "")
    )
    after = load.since(cut + NOTICE + MARGIN)
    assert after, "no request was sent after the edge noticed the cut"
    assert {status for _, status, _ in after} == {200}, [a for a in after if a[1] != 200][:10]
    assert lost.id not in {machine for sent, _, machine in after if sent < healed}
    assert noticed <= NOTICE + MARGIN, f"a request sent {noticed:.2f}s after the cut still went to host b or failed"


def test_autostop_autostart_and_create_in_request_across_hosts(fleet: DevFleet, tmp_path: Path) -> None:
    idle = 'auto_stop = "stop"\nidle_timeout = "1s"\n'
    deploy(fleet, tmp_path, "napper", f"[regions]\n{REGION} = 1\n[http_service]\n{idle}")
    deploy(fleet, tmp_path, "fromzero", f"[regions]\n{REGION} = 0\n[http_service]\nauto_create = true\n{idle}")
    (napper,) = listing(fleet, "napper")
    assert arun(get(fleet, "napper"))[0] == 200
    wait_until(lambda: listing(fleet, "napper")[0].state == "stopped", "napper autostopped by the edge", 30, 0.3)
    status, machine = arun(get(fleet, "napper"))  # autostart: the edge starts it inside the request
    assert (status, machine) == (200, napper.id)
    assert listing(fleet, "napper")[0].state == "started"

    status, machine = arun(get(fleet, "fromzero"))  # create-in-request: made on a worker host, served through it
    assert status == 200
    (made,) = listing(fleet, "fromzero")
    assert made.id == machine and host_of(fleet, made.worker_id) in ("b", "c", "d")
    assert made.address == fleet.placement[f"worker-{made.worker_id}"].address
    wait_until(lambda: listing(fleet, "fromzero")[0].state == "stopped", "fromzero autostopped by the edge", 30, 0.3)
