"""A secure fleet of hosts (issue 40), what `fauxmad dev --hosts 4 --secure` runs: mutual TLS and nkey users,
nats-server, the broker and the edge on host a, the edge acting as `proxy-1` (the proxy role), a worker on each
of hosts b, c and d. The edge reaches a machine on another host through that host's worker's backhaul, over
mutual TLS with the fleet's CA; nothing answers a client without a certificate of the fleet.

One fleet for the module (CI's time); the app is the first hour's, examples/edge/fauxmad.toml, as written.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess

import pytest

from bus.contract.backhaul import ping_line
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.devhosts import unavailable
from tests.helpers import ROOT, arun, fleet_fixture
from tests.helpers import fauxmad as run_fauxmad
from tests.hosts.test_fleet_on_hosts import get, host_of, netns_of

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs hosts: {REASON}")

REGION = "mad"  # examples/edge/fauxmad.toml's region
APP = "hello-edge"


fleet = fleet_fixture(
    FleetSpec(regions=[REGION], workers_per_region=3, hosts=4, secure=True, cpus=4, memory_mb=2048, deadline_ms=1000)
)


def fauxmad(fleet: DevFleet, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI on the laptop as the fleet's operator (its credentials: mutual TLS, its nkey)."""
    assert fleet.operator_creds is not None
    return run_fauxmad(*args, url=fleet.url, env={"FAUXMAD_CREDS": fleet.operator_creds}, timeout=180)


def test_the_edge_on_host_a_runs_as_the_proxy_identity(fleet: DevFleet) -> None:
    assert fleet.url.startswith("tls://"), fleet.url
    processes = dict(fleet.processes)
    assert netns_of(processes["proxy"].pid) == fleet.placement["proxy"].netns == fleet.placement["broker-1"].netns
    assert fleet.commands["proxy"][0] == "proxy"
    with open(f"/proc/{processes['proxy'].pid}/environ", "rb") as f:
        assert f"FAUXMAD_CREDS={fleet.creds_of('proxy-1')}".encode() in f.read().split(b"\0")


def test_the_app_lands_on_other_hosts_and_machine_list_names_their_addresses(fleet: DevFleet) -> None:
    done = fauxmad(fleet, "deploy", "-c", str(ROOT / "examples" / "edge" / "fauxmad.toml"))
    assert done.returncode == 0, done.stdout + done.stderr
    shown = fauxmad(fleet, "machine", "list", "--app", APP, "--json")
    assert shown.returncode == 0, shown.stderr
    machines = [m for m in json.loads(shown.stdout) if m["state"] == "started"]
    assert len(machines) == 2, machines
    for machine in machines:
        host = fleet.placement[f"worker-{machine['worker_id']}"]
        assert host.name in ("b", "c", "d") and machine["address"] == host.address, machine
    assert len({m["address"] for m in machines}) == 2  # two hosts (the auction's default curves spread them)


def test_every_request_through_the_edge_answers_200_from_the_other_hosts(fleet: DevFleet) -> None:
    async def run() -> list[tuple[int, str]]:
        return [await get(fleet, APP) for _ in range(12)]

    answers = arun(run())
    assert [status for status, _ in answers] == [200] * 12, answers
    shown = json.loads(fauxmad(fleet, "machine", "list", "--app", APP, "--json").stdout)
    workers = {m["id"]: m["worker_id"] for m in shown}
    assert {host_of(fleet, workers[machine]) for _, machine in answers} <= {"b", "c", "d"}


def test_a_backhaul_without_the_fleets_certificate_answers_nothing(fleet: DevFleet) -> None:
    """The machines' way in from other hosts is mutual TLS only: a plain connection's ping is never answered."""
    listed = json.loads(fauxmad(fleet, "workers", "--json").stdout)
    worker = listed[0]
    assert worker["backhaul"] > 0, worker

    def plain_ping() -> bytes:
        with socket.create_connection((worker["address"], worker["backhaul"]), timeout=5) as s:
            s.settimeout(5)
            s.sendall(ping_line())
            try:
                return s.recv(64)
            except (TimeoutError, OSError):
                return b""

    answer = arun(asyncio.to_thread(plain_ping))
    assert not answer.startswith(b"ok"), answer
