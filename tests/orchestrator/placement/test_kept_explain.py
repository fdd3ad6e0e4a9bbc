"""Every placement's explanation is kept in the machine's `created` event: `machine explain ID` shows it later."""

from __future__ import annotations

import json
import subprocess

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import fauxmad, fleet_fixture

fleet = fleet_fixture(FleetSpec(regions=["ex"], workers_per_region=3, cpus=4, memory_mb=4096, brokers=1))


def cli(fleet: DevFleet, *args: str) -> subprocess.CompletedProcess[str]:
    return fauxmad(*args, url=fleet.url, columns=160, timeout=60)


def test_machine_explain_shows_why_it_landed_where_it_did(fleet: DevFleet) -> None:
    first = json.loads(
        cli(fleet, "machine", "run", "-a", "why", "-r", "ex", "--skip-launch", "--json", "--", "sleep", "60").stdout
    )
    second = json.loads(
        cli(fleet, "machine", "run", "-a", "why", "-r", "ex", "--skip-launch", "--json", "--", "sleep", "60").stdout
    )
    kept = json.loads(cli(fleet, "machine", "explain", second["id"], "-a", "why", "--json").stdout)
    assert kept["chosen"] == second["worker_id"] and kept["asked"] == 3 and kept["answered"] == 3
    by_worker = {c["worker_id"]: c for c in kept["candidates"]}
    # the spread scorer is why the second machine is not beside the first
    assert by_worker[first["worker_id"]]["subscores"]["spread"] < 0
    assert by_worker[second["worker_id"]]["rank"] == 1
    table = cli(fleet, "machine", "explain", second["id"], "-a", "why")
    assert table.returncode == 0 and f"placed on {second['worker_id']}" in table.stdout, table.stdout + table.stderr
    fleet.destroy_all_machines()
