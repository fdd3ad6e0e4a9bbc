"""`status` tells the truth after changes: checks survive a relabel, a lost host's machines say so, ids are whole.

Before: a relabel in place (scale, rollback, a no-change deploy) showed healthy machines with checks `-`;
machines on a worker whose heartbeat expired still showed `started primary`, so a region with a count of 2
showed 4 primaries; `status` cut machine ids at 80 columns; release and role were `""` in JSON.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import fauxmad, fleet_fixture, wait_until
from tests.orchestrator.reconcile.test_reconcile import machines, primaries, write_spec

fleet = fleet_fixture(FleetSpec(regions=["st"], workers_per_region=3, cpus=6, memory_mb=6144, brokers=1))


def cli(fleet: DevFleet, tmp_path: Path, *args: str, columns: int = 200) -> subprocess.CompletedProcess[str]:
    return fauxmad(*args, url=fleet.url, columns=columns, env={"FAUXMAD_VIEW": str(tmp_path / "view.sqlite")})


def status(fleet: DevFleet, tmp_path: Path, app: str) -> dict[str, Any]:
    result = cli(fleet, tmp_path, "status", "--app", app, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_checks_survive_a_relabel_and_a_lost_host_is_shown(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "truth", regions="st = 2", spares=0)
    deployed = cli(fleet, tmp_path, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stderr
    # a relabel in place: scale to the same count makes a new release without restarting anything
    scaled = cli(fleet, tmp_path, "scale", "count", "2", "--app", "truth")
    assert scaled.returncode == 0, scaled.stderr
    wait_until(
        lambda: all(m.config.metadata.get("fauxmad_release") == "2" for m in machines(fleet, "truth")),
        "the relabel",
        20,
    )
    rows = status(fleet, tmp_path, "truth")["machines"]
    assert len(rows) == 2 and all(r["release"] == "2" for r in rows), rows
    assert all(r["checks"] == {"http": "passing"} for r in rows), rows
    assert all(r["host_status"] == "ok" for r in rows), rows

    victim = primaries(machines(fleet, "truth"))[0]
    fleet.kill_host(victim.worker_id)
    seen: list[dict[str, dict[str, Any]]] = []

    def shown_unreachable() -> bool:  # once the heartbeat key expires (3 s TTL)
        seen.append({r["id"]: r for r in status(fleet, tmp_path, "truth")["machines"]})
        return seen[-1][victim.id]["host_status"] == "unreachable"

    wait_until(shown_unreachable, f"status to show {victim.worker_id} unreachable", 15)
    rows = seen[-1]
    assert all(r["host_status"] == "ok" for mid, r in rows.items() if mid != victim.id)
    fleet.respawn(f"worker-{victim.worker_id}")
    fleet.destroy_all_machines()


def test_ids_are_whole_at_80_columns_and_missing_labels_are_null(fleet: DevFleet, tmp_path: Path) -> None:
    ran = cli(
        fleet,
        tmp_path,
        "machine",
        "run",
        "--app",
        "bare",
        "--region",
        "st",
        "--skip-launch",
        "--json",
        "--",
        "sleep",
        "60",
    )
    assert ran.returncode == 0, ran.stderr
    machine_id = json.loads(ran.stdout)["id"]
    rows = status(fleet, tmp_path, "bare")["machines"]
    assert rows[0]["release"] is None and rows[0]["role"] is None, rows
    table = cli(fleet, tmp_path, "status", "--app", "bare", columns=80)
    assert table.returncode == 0, table.stderr
    assert machine_id in table.stdout, table.stdout
    fleet.destroy_all_machines()
