"""The reconcilers against a real fleet: nats-server, worker processes, a broker, machine processes.

Deploys run the real CLI as a subprocess; the assertions ask the workers (through the broker API).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.contract.machines import Machine
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.reconcile.observe import health
from tests import helpers
from tests.helpers import ROOT, arun, fleet_fixture, start_operator, wait_until

APP_PY = ROOT / "examples" / "sandwich" / "app.py"


fleet = fleet_fixture(FleetSpec(regions=["mad", "syd"], workers_per_region=3, cpus=6, memory_mb=6144, brokers=1))


def write_spec(
    path: Path,
    app: str,
    *,
    regions: str = "mad = 2\nsyd = 2",
    version: str = "v1",
    spares: int = 1,
    strategy: str = "rolling",
    cmd: str | None = None,
    wait: str = "30s",  # a good release is waited for as long as it takes to be healthy: CI91 had a machine of
    # `write_spec`'s Python app not listening 6 s after its start (four files at a time on two cores); a test
    # of a release that never gets healthy says how long it waits (`wait="3s"`)
    max_unavailable: str = "1",
    extra: str = "",
) -> Path:
    command = cmd or json.dumps([sys.executable, str(APP_PY)])
    path.write_text(f"""
app = "{app}"
cmd = {command}
env = {{ VERSION = "{version}" }}
[guest]
cpus = 1
memory_mb = 64
[regions]
{regions}
[checks.http]
type = "http"
path = "/health"
interval = "200ms"
timeout = "1s"
[deploy]
strategy = "{strategy}"
max_unavailable = {max_unavailable}
spares = {spares}
wait_timeout = "{wait}"
{extra}""")
    return path


def fauxmad(
    fleet: DevFleet, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return helpers.fauxmad(*args, url=fleet.url, columns=120, timeout=timeout, env=env)


def machines(fleet: DevFleet, app: str) -> list[Machine]:
    async def go() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return await client.list(app)
        finally:
            await client.close()

    return [m for m in arun(go()) if m.state != "destroyed"]


def role(m: Machine) -> str:
    return m.config.metadata.get("fauxmad_role", "")


def primaries(found: list[Machine], region: str | None = None) -> list[Machine]:
    return [m for m in found if role(m) == "primary" and (region is None or m.region == region)]


def spares(found: list[Machine]) -> list[Machine]:
    return [m for m in found if role(m) == "spare"]


def destroy(fleet: DevFleet, app: str) -> None:
    result = fauxmad(fleet, "apps", "destroy", app, "--yes")
    assert result.returncode == 0, result.stderr
    assert machines(fleet, app) == []


def assert_converged(found: list[Machine], counts: dict[str, int], release: str, version: str) -> None:
    for region, count in counts.items():
        ps = primaries(found, region)
        assert len(ps) == count, [(m.id, m.worker_id, m.state) for m in ps]
        for m in ps:
            assert m.state == "started" and health(m)[0], (m.id, m.state, m.checks)
            assert m.config.metadata["fauxmad_release"] == release and m.config.env["VERSION"] == version


def test_two_region_deploy_puts_spares_on_other_workers(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "twin")
    result = fauxmad(fleet, "deploy", "-c", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "v1 deployed" in result.stdout
    found = machines(fleet, "twin")
    assert_converged(found, {"mad": 2, "syd": 2}, "1", "v1")
    wait_until(lambda: len(spares(machines(fleet, "twin"))) == 4, "four spares", 10)
    found = machines(fleet, "twin")
    by_id = {m.id: m for m in found}
    for spare in spares(found):
        primary = by_id[spare.config.standbys[0]]
        assert spare.state == "created" and spare.region == primary.region
        assert spare.worker_id != primary.worker_id
    releases = json.loads(fauxmad(fleet, "releases", "-a", "twin", "--json").stdout)
    assert releases["current"] == 1 and [r["status"] for r in releases["releases"]] == ["complete"]
    again = fauxmad(fleet, "reconcile", "-a", "twin")  # converged: a pass changes nothing
    assert again.returncode == 0 and "converged" in again.stdout
    assert {(m.id, m.instance_id) for m in machines(fleet, "twin")} == {(m.id, m.instance_id) for m in found}
    destroy(fleet, "twin")


def test_a_failing_release_is_rolled_back_in_every_region(fleet: DevFleet, tmp_path: Path) -> None:
    good = write_spec(tmp_path / "good.toml", "fall", spares=0)
    assert fauxmad(fleet, "deploy", "-c", str(good)).returncode == 0
    bad = write_spec(
        tmp_path / "bad.toml", "fall", spares=0, version="v2", wait="3s", cmd='["sleep", "600"]'
    )  # runs, but nothing answers the http check
    result = fauxmad(fleet, "deploy", "-c", str(bad))
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert "v2 failed" in message and "not healthy" in message and "rolled back to v1 in every region" in message
    assert "Traceback" not in result.stderr
    assert_converged(machines(fleet, "fall"), {"mad": 2, "syd": 2}, "1", "v1")
    releases = json.loads(fauxmad(fleet, "releases", "-a", "fall", "--json").stdout)
    assert releases["current"] == 1
    statuses = {r["version"]: (r["status"], r["reason"]) for r in releases["releases"]}
    assert statuses[1] == ("complete", "") and statuses[2][0] == "failed"  # a failed release stays failed
    assert "not healthy within 3s" in statuses[2][1] and statuses[2][1] in message
    destroy(fleet, "fall")


def test_rollback_on_demand_and_scale(fleet: DevFleet, tmp_path: Path) -> None:
    for version in ("v1", "v2", "v3"):
        spec = write_spec(tmp_path / f"{version}.toml", "back", version=version, spares=0, regions="mad = 2")
        assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    result = fauxmad(fleet, "rollback", "1", "-a", "back")
    assert result.returncode == 0, result.stderr
    assert_converged(machines(fleet, "back"), {"mad": 2}, "1", "v1")
    before = {m.id: m.instance_id for m in machines(fleet, "back")}
    scaled = fauxmad(fleet, "scale", "count", "3", "-a", "back", "--region", "mad,syd")
    assert scaled.returncode == 0, scaled.stderr
    found = machines(fleet, "back")
    assert_converged(found, {"mad": 2, "syd": 1}, "4", "v1")
    assert all(before[m.id] == m.instance_id for m in found if m.id in before)  # relabelled, not restarted
    listed = json.loads(fauxmad(fleet, "apps", "list", "--json").stdout)
    assert {
        "app": "back",
        "release": 4,
        "status": "complete",
        "strategy": "rolling",
        "regions": {"mad": 2, "syd": 1},
    } in listed
    destroy(fleet, "back")


@pytest.mark.timeout(300)  # five CLI runs and a kill: near 120 s on a busy 2-core machine
def test_a_reconciler_killed_mid_deploy_is_finished_by_the_next_run(fleet: DevFleet, tmp_path: Path) -> None:
    v1 = write_spec(tmp_path / "v1.toml", "half", regions="mad = 3", spares=0)
    assert fauxmad(fleet, "deploy", "-c", str(v1)).returncode == 0
    v2 = write_spec(tmp_path / "v2.toml", "half", regions="mad = 3", spares=0, version="v2")
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT))
    deploy = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "deploy", "-c", str(v2)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=str(ROOT),
    )
    try:
        wait_until(
            lambda: any(m.config.env.get("VERSION") == "v2" for m in machines(fleet, "half")),
            "the first machine on v2",
            30,
        )
    finally:
        deploy.send_signal(signal.SIGKILL)
        deploy.wait(10)
    halfway = machines(fleet, "half")
    assert any(m.config.env["VERSION"] == "v1" for m in halfway), "the deploy finished before it was killed"
    result = fauxmad(fleet, "reconcile", "-a", "half")
    assert result.returncode == 0, result.stdout + result.stderr
    assert_converged(machines(fleet, "half"), {"mad": 3}, "2", "v2")
    releases = json.loads(fauxmad(fleet, "releases", "-a", "half", "--json").stdout)
    assert {r["version"]: r["status"] for r in releases["releases"]} == {1: "complete", 2: "complete"}
    destroy(fleet, "half")


def test_a_dead_host_fails_over_to_spares_and_its_return_stops_the_replaced(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "ha", regions="syd = 2", spares=1)
    assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    wait_until(lambda: len(spares(machines(fleet, "ha"))) == 2, "two spares", 10)
    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, "ha")
    try:
        found = machines(fleet, "ha")
        victim = primaries(found)[0]
        standby = next(s for s in spares(found) if s.config.standbys == [victim.id])
        # the host dies: its worker and its machines' processes at once
        fleet.kill_host(victim.worker_id)
        killed = time.monotonic()
        wait_until(
            lambda: any(m.id == standby.id and m.state == "started" for m in machines(fleet, "ha")),
            "the spare to start",
            15,
        )
        print(f"\nhost death -> spare started: {time.monotonic() - killed:.2f}s")
        found = machines(fleet, "ha")
        promoted = next(m for m in found if m.id == standby.id)
        assert role(promoted) == "primary" and promoted.config.metadata["fauxmad_replaces"] == victim.id
        assert promoted.region == "syd"
        wait_until(
            lambda: (
                all(health(m)[0] for m in primaries(machines(fleet, "ha")))
                and len([m for m in primaries(machines(fleet, "ha")) if m.state == "started"]) == 2
            ),
            "two healthy primaries",
            15,
        )
        # the host returns: the machine that was replaced does not run next to its successor
        fleet.respawn(f"worker-{victim.worker_id}")

        def replaced_settled() -> bool:
            found = machines(fleet, "ha")
            old = next((m for m in found if m.id == victim.id), None)
            return old is not None and old.state != "started" and role(old) == "spare"

        wait_until(replaced_settled, "the replaced machine to be stopped and kept as a spare", 30)
        wait_until(lambda: len(spares(machines(fleet, "ha"))) == 2, "spares back to two", 15)
        found = machines(fleet, "ha")
        running = [m for m in found if m.state == "started"]
        assert sorted(m.id for m in running) == sorted(m.id for m in primaries(found)) and len(running) == 2
    finally:
        operator.send_signal(signal.SIGINT)
        code = operator.wait(20)
    assert code == 0, log.read_text()
    assert "promote" in log.read_text()
    destroy(fleet, "ha")


def test_the_operator_leaves_the_machines_of_the_apps_jobs_alone(fleet: DevFleet, tmp_path: Path) -> None:
    """CI117: a job's machine (the `machine` runner) of an app the operator converges counted as one primary too many:
    the operator destroyed it, every attempt (signal 9), and the job was dead-lettered. A job's machine is the job's
    (`JOB_LABEL`), not the app's. Here the job runs 4 s beside the app's one primary, in the same region."""
    spec = write_spec(tmp_path / "fauxmad.toml", "withjob", regions="mad = 1", spares=0)
    assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, "withjob")
    try:
        done = fauxmad(
            fleet,
            "job",
            "submit",
            "-a",
            "withjob",
            "-r",
            "mad",
            "--wait",
            "--json",
            "--",
            "sh",
            "-c",
            "sleep 4; echo made",
        )
        assert done.returncode == 0, done.stdout + done.stderr
        (job,) = json.loads(done.stdout)
        assert job["state"] == "succeeded" and len(job["attempts"]) == 1 and job["stdout"] == "made\n", job
        assert len(primaries(machines(fleet, "withjob"))) == 1
    finally:
        operator.send_signal(signal.SIGINT)
        code = operator.wait(20)
    assert code == 0, log.read_text()
    assert "destroy" not in log.read_text(), log.read_text()
    destroy(fleet, "withjob")


def test_draining_a_worker_moves_its_machines_healthy_first(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "move", regions="mad = 2", spares=1)
    assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    wait_until(lambda: len(spares(machines(fleet, "move"))) == 2, "two spares", 10)
    target = primaries(machines(fleet, "move"))[0].worker_id
    try:
        result = fauxmad(fleet, "worker", "drain", target)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"{target} is drained" in result.stdout
        found = machines(fleet, "move")
        assert not [m for m in found if m.worker_id == target]
        assert_converged(found, {"mad": 2}, "1", "v1")
        workers = json.loads(fauxmad(fleet, "workers", "--json").stdout)
        assert next(w for w in workers if w["worker_id"] == target)["cordoned"] is True
    finally:
        assert fauxmad(fleet, "worker", "uncordon", target).returncode == 0
    destroy(fleet, "move")


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            'app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n[deploy]\nmax_unavailble = 1\n',
            "unknown key `deploy.max_unavailble`",
        ),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = "two"\n', "`regions.mad`: expected `int`, got `str`"),
        ('app = "x"\n[regions]\nmad = 1\n', "missing required key `cmd`"),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n[checks.web]\ntype = "udp"\n', "`checks.web.type`"),
        ('app = "x" cmd', "not valid TOML"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "fauxmad.toml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "FAUXMAD_NATS_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "deploy", "-c", str(path)],
        capture_output=True,
        text=True,
        env=dict(env, PYTHONPATH=str(ROOT)),
        timeout=30,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
