"""What a person deploying sees: the CLI as a subprocess against a real fleet (issue 10's deploy items).

Each test runs `fauxmad ...` the way a user would and checks what it printed, what it exited with, and
what the fleet and KV look like afterwards (asked of the workers and of `releases --json`).
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.cli.runtime import EXIT_CONFLICT
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.reconcile.observe import health
from tests.helpers import ROOT, arun, connect_nats, fleet_fixture, wait_until
from tests.orchestrator.reconcile.test_reconcile import (
    assert_converged,
    destroy,
    fauxmad,
    machines,
    primaries,
    spares,
    write_spec,
)

README_SPEC = ROOT / "examples" / "sandwich" / "fauxmad.toml"


fleet = fleet_fixture(FleetSpec(regions=["mad", "syd"], workers_per_region=3, cpus=4, memory_mb=4096, brokers=1))


def crashing(message: str = "boom: settings.toml not found", code: int = 3) -> str:
    """A cmd (TOML) whose process writes one line to stderr and exits at once."""
    script = f"import sys; print({message!r}, file=sys.stderr); sys.exit({code})"
    return json.dumps([sys.executable, "-c", script])


def releases(fleet: DevFleet, app: str) -> dict[str, object]:
    result = fauxmad(fleet, "releases", "-a", app, "--json")
    assert result.returncode == 0, result.stderr
    found: dict[str, object] = json.loads(result.stdout)
    return found


def assert_unknown(fleet: DevFleet, app: str) -> None:
    """`app` has no release, no machine, no record: `releases` says so, exit 4 (docs/reference/exit-codes.md)."""
    result = fauxmad(fleet, "releases", "-a", app, "--json")
    assert result.returncode == 4 and f"no app '{app}'" in result.stderr, result.stderr


def statuses(fleet: DevFleet, app: str) -> dict[int, tuple[str, str]]:
    found = releases(fleet, app)["releases"]
    assert isinstance(found, list)
    return {r["version"]: (r["status"], r["reason"]) for r in found}


def error_lines(result: object) -> list[str]:
    stderr = getattr(result, "stderr", "")
    return [line for line in stderr.splitlines() if line.strip()]


def assert_no_log_lines(stderr: str) -> None:
    for word in ("Traceback", "WARNING", "ERROR", "INFO", "orchestrator.", "bus."):
        assert word not in stderr, stderr


# ---------------------------------------------------------------------------------------------------
# 2. the README's app spec runs as written; a machine that exits fails its region at once, with its stderr


def test_the_readme_spec_is_the_shipped_example() -> None:
    readme = (ROOT / "docs" / "reference" / "fauxmad-toml.md").read_text()
    block = re.search(r"```toml\n(app = .*?)```", readme, re.S)  # the app spec (not the fleets file)
    assert block is not None
    assert block.group(1) == README_SPEC.read_text()


def test_the_readme_example_deploys_as_written_from_the_repository(fleet: DevFleet) -> None:
    started = time.perf_counter()
    result = fauxmad(fleet, "deploy", "-c", "examples/sandwich/fauxmad.toml")  # cwd: the repository
    assert result.returncode == 0, result.stdout + result.stderr
    assert "v1 deployed" in result.stdout
    print(f"\nREADME example: 3 + 2 machines healthy in {time.perf_counter() - started:.1f}s")
    found = machines(fleet, "sandwich")
    for region, count in {"mad": 3, "syd": 2}.items():
        ps = primaries(found, region)
        assert len(ps) == count
        for m in ps:
            assert m.state == "started" and health(m)[0], (m.id, m.state, m.checks)
            assert m.config.workdir == str(README_SPEC.parent)
            with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/", timeout=5) as answer:
                body = json.loads(answer.read())
            assert body["machine"] == m.id and body["region"] == region
    destroy(fleet, "sandwich")


@pytest.mark.parametrize("policy", ["no", "on-failure"])
def test_a_machine_that_exits_fails_the_deploy_at_once_with_its_stderr(
    fleet: DevFleet, tmp_path: Path, policy: str
) -> None:
    app = f"crash-{policy.replace('-', '')}"
    spec = write_spec(
        tmp_path / "fauxmad.toml",
        app,
        cmd=crashing(),
        wait="60s",
        spares=1,
        extra=f'[restart]\npolicy = "{policy}"\n',
    )
    started = time.perf_counter()
    result = fauxmad(fleet, "deploy", "-c", str(spec))
    took = time.perf_counter() - started
    print(f"\nrestart {policy}: failed in {took:.1f}s (wait_timeout 60s)")
    assert result.returncode == 1
    # not the 60 s wait running out: the one error names the crash (exit code 3, the command's own words)
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr  # one distinct error: one line, whatever the number of machines
    assert "v1 failed" in lines[0] and "exited with code 3" in lines[0], lines[0]
    assert "boom: settings.toml not found" in lines[0]
    assert_no_log_lines(result.stderr)
    # 7: a failure after the feasibility check removes what it created; nothing stays current
    assert machines(fleet, app) == []
    found = releases(fleet, app)
    assert found["current"] is None
    [(version, (status, reason))] = statuses(fleet, app).items()
    assert version == 1 and status == "failed" and "exited with code 3" in reason and "boom" in reason


def test_the_working_directory_defaults_to_the_spec_files_directory(fleet: DevFleet, tmp_path: Path) -> None:
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "app.py").write_text((ROOT / "examples" / "sandwich" / "app.py").read_text())
    spec = write_spec(tmp_path / "svc" / "fauxmad.toml", "here", cmd='["python3", "app.py"]', regions="mad = 1")
    result = fauxmad(fleet, "deploy", "-c", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    [m] = primaries(machines(fleet, "here"))
    assert m.config.workdir == str(tmp_path / "svc") and health(m)[0]
    destroy(fleet, "here")
    # the same file elsewhere, without its app.py: the process cannot find it, and the deploy says so at once
    (tmp_path / "empty").mkdir()
    moved = write_spec(tmp_path / "empty" / "fauxmad.toml", "there", cmd='["python3", "app.py"]', regions="mad = 1")
    result = fauxmad(fleet, "deploy", "-c", str(moved))
    assert result.returncode == 1
    [line] = error_lines(result)
    assert "exited with code 2" in line and "app.py" in line and "No such file or directory" in line, line


# ---------------------------------------------------------------------------------------------------
# 4. rollback to a failed release needs --force; a failed rollback returns to the last good release


def test_rollback_to_a_failed_release_is_refused_and_a_failed_rollback_goes_back(
    fleet: DevFleet, tmp_path: Path
) -> None:
    good = write_spec(tmp_path / "v1.toml", "undo", regions="mad = 2", spares=0)
    assert fauxmad(fleet, "deploy", "-c", str(good)).returncode == 0
    bad = write_spec(
        tmp_path / "v2.toml", "undo", regions="mad = 2", spares=0, version="v2", cmd=crashing(), wait="60s"
    )
    result = fauxmad(fleet, "deploy", "-c", str(bad))
    assert result.returncode == 1 and "rolled back to v1" in result.stderr, result.stderr
    before = statuses(fleet, "undo")
    assert before[1] == ("complete", "") and before[2][0] == "failed" and "exited with code 3" in before[2][1]
    instances = {m.id: m.instance_id for m in machines(fleet, "undo")}

    refused = fauxmad(fleet, "rollback", "2", "-a", "undo")
    assert refused.returncode == EXIT_CONFLICT
    [line] = error_lines(refused)
    assert "v2 failed" in line and "--force" in line, line
    assert {m.id: m.instance_id for m in machines(fleet, "undo")} == instances  # nothing touched
    assert statuses(fleet, "undo") == before and releases(fleet, "undo")["current"] == 1

    forced = fauxmad(fleet, "rollback", "2", "--force", "-a", "undo")
    assert forced.returncode == 1  # ended by the crash it names below, not by a wait running out
    [line] = error_lines(forced)
    assert "rollback to v2 failed" in line and "exited with code 3" in line and "back on v1" in line, line
    assert_no_log_lines(forced.stderr)
    assert releases(fleet, "undo")["current"] == 1
    assert statuses(fleet, "undo") == before  # no release relabelled, no reason overwritten
    assert_converged(machines(fleet, "undo"), {"mad": 2}, "1", "v1")
    destroy(fleet, "undo")


def test_a_failed_deploy_goes_back_to_the_release_the_app_ran(fleet: DevFleet, tmp_path: Path) -> None:
    for version in ("v1", "v2"):
        spec = write_spec(tmp_path / f"{version}.toml", "whence", regions="mad = 1", spares=0, version=version)
        assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    assert fauxmad(fleet, "rollback", "1", "-a", "whence").returncode == 0  # v2 is good, but the app runs v1
    bad = write_spec(tmp_path / "v3.toml", "whence", regions="mad = 1", spares=0, version="v3", cmd=crashing())
    result = fauxmad(fleet, "deploy", "-c", str(bad))
    assert result.returncode == 1 and "rolled back to v1 in every region" in result.stderr, result.stderr
    assert_converged(machines(fleet, "whence"), {"mad": 1}, "1", "v1")
    assert {v: status for v, (status, _) in statuses(fleet, "whence").items()} == {
        1: "complete",
        2: "rolled_back",
        3: "failed",
    }
    destroy(fleet, "whence")


# ---------------------------------------------------------------------------------------------------
# 7. a deploy that cannot work fails before it touches anything


def test_a_region_without_workers_or_room_fails_before_anything_is_touched(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "nowhere", regions="mad = 40\nsyd = 1\nlhr = 1", spares=0)
    result = fauxmad(fleet, "deploy", "-c", str(spec))
    assert result.returncode == 1  # refused by the feasibility check (its two lines below), before any wait
    lines = error_lines(result)
    assert len(lines) == 2, result.stderr  # one line per distinct error
    assert any("lhr" in line and "no live workers" in line for line in lines), lines
    assert any("mad" in line and "room for" in line and "40" in line for line in lines), lines
    assert_no_log_lines(result.stderr)
    assert machines(fleet, "nowhere") == []
    assert_unknown(fleet, "nowhere")  # no release, no record: the fleet does not know the app


# ---------------------------------------------------------------------------------------------------
# 8. the releases table keeps its columns with a long failure reason; absent labels are null in JSON


def test_the_releases_table_keeps_every_column_readable_with_a_long_reason(fleet: DevFleet, tmp_path: Path) -> None:
    long = "boom: " + "the configuration service did not answer and nothing can start without it " * 4
    spec = write_spec(tmp_path / "fauxmad.toml", "wordy", regions="mad = 1", spares=0, cmd=crashing(long))
    assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 1
    good = write_spec(tmp_path / "good.toml", "wordy", regions="mad = 1", spares=0)
    assert fauxmad(fleet, "deploy", "-c", str(good)).returncode == 0
    table = fauxmad(fleet, "releases", "-a", "wordy", env={"COLUMNS": "100"})
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert all(len(line) <= 100 for line in lines), table.stdout
    rows = {line.split()[0]: line for line in lines if re.match(r"^\s*v\d", line)}
    for version, status in (("v1", "failed"), ("v2", "complete")):
        row = next(line for key, line in rows.items() if key == version)
        assert status in row and "rolling" in row and "mad=1" in row, table.stdout
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row), table.stdout
    assert "boom" in table.stdout
    listed = json.loads(fauxmad(fleet, "apps", "list", "--json").stdout)
    assert next(a for a in listed if a["app"] == "wordy")["release"] == 2
    destroy(fleet, "wordy")


# ---------------------------------------------------------------------------------------------------
# 9. --dry-run, --json, --detach; nothing to change; counts set by `scale`


def test_dry_run_shows_the_plan_and_touches_nothing(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "preview", regions="mad = 2\nsyd = 1", spares=1)
    table = fauxmad(fleet, "deploy", "-c", str(spec), "--dry-run")
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines() if " create" in line]
    assert [(*row[:3], next(word for word in row if word in ("primary", "spare"))) for row in rows] == [
        ("1", "mad", "create", "primary"),  # `create x2`: alike creates are one row
        ("1", "syd", "create", "primary"),
        ("2", "mad", "create", "spare"),
        ("2", "mad", "create", "spare"),
        ("2", "syd", "create", "spare"),
    ], table.stdout
    assert "create x2   new-1..new-2" in table.stdout and "spare for new-3" in table.stdout
    plan = json.loads(fauxmad(fleet, "deploy", "-c", str(spec), "--dry-run", "--json").stdout)
    assert plan["app"] == "preview" and plan["release"] == 1 and plan["current"] is None
    assert plan["changes"] is True and plan["feasible"] is True and plan["problems"] == []
    kinds = sorted((a["action"], a["region"], a["role"]) for a in plan["actions"])
    assert kinds == sorted(
        [("create", "mad", "primary")] * 2
        + [("create", "syd", "primary")]
        + [("create", "mad", "spare")] * 2
        + [("create", "syd", "spare")]
    )
    assert all(a["machine_id"] is None and a["from_release"] is None for a in plan["actions"])
    assert machines(fleet, "preview") == []
    assert_unknown(fleet, "preview")


def test_dry_run_of_an_update_and_unlabelled_machines_in_json(fleet: DevFleet, tmp_path: Path) -> None:
    run = fauxmad(fleet, "machine", "run", "-a", "loose", "-r", "mad", "--json", "--", "sleep", "600")
    assert run.returncode == 0, run.stderr
    loose = json.loads(run.stdout)["id"]
    spec = write_spec(tmp_path / "fauxmad.toml", "loose", regions="mad = 1", spares=0)
    plan = json.loads(fauxmad(fleet, "deploy", "-c", str(spec), "--dry-run", "--json").stdout)
    [update] = [a for a in plan["actions"] if a["machine_id"] == loose]
    assert update["action"] == "update" and update["starts"] is True
    assert update["from_release"] is None and update["from_role"] is None  # null, not ""
    assert update["release"] == 1 and update["role"] == "primary"
    destroy(fleet, "loose")


def test_json_detach_no_changes_and_the_scale_warning(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "knobs", regions="mad = 2\nsyd = 1", spares=0)
    first = fauxmad(fleet, "deploy", "-c", str(spec), "--json")
    assert first.returncode == 0, first.stderr
    outcome = json.loads(first.stdout)
    assert outcome["app"] == "knobs" and outcome["release"] == 1 and outcome["ok"] is True
    assert outcome["changed"] is True and outcome["status"] == "complete" and outcome["rolled_back_to"] is None
    instances = {m.id: m.instance_id for m in machines(fleet, "knobs")}

    again = fauxmad(fleet, "deploy", "-c", str(spec))
    assert again.returncode == 0, again.stderr
    assert "already at v1" in again.stdout
    assert list(statuses(fleet, "knobs")) == [1]  # no release created
    assert {m.id: m.instance_id for m in machines(fleet, "knobs")} == instances
    quiet = json.loads(fauxmad(fleet, "deploy", "-c", str(spec), "--json").stdout)
    assert quiet["changed"] is False and quiet["release"] == 1 and quiet["ok"] is True

    assert fauxmad(fleet, "scale", "count", "4", "-a", "knobs").returncode == 0  # v2: mad=2, syd=2
    back = fauxmad(fleet, "deploy", "-c", str(spec))
    assert back.returncode == 0, back.stderr
    [warning] = error_lines(back)
    assert warning.startswith("fauxmad: warning:") and "scale" in warning and "syd" in warning, warning
    assert "v3 deployed" in back.stdout
    assert_converged(machines(fleet, "knobs"), {"mad": 2, "syd": 1}, "3", "v1")

    v2 = write_spec(tmp_path / "v2.toml", "knobs", regions="mad = 2\nsyd = 1", spares=0, version="v2")
    detached = fauxmad(fleet, "deploy", "-c", str(v2), "--detach", env={"FAUXMAD_HOME": str(tmp_path / "home")})
    assert detached.returncode == 0, detached.stderr  # returned with the deploy in the background: said below,
    # and the background process's own log says it deployed v4 (a wait here would have printed "v4 deployed")
    assert "v4 deployed" not in detached.stdout, detached.stdout
    assert "v4" in detached.stdout and "background" in detached.stdout, detached.stdout
    wait_until(lambda: statuses(fleet, "knobs").get(4, ("", ""))[0] == "complete", "v4 to complete", 60)
    assert_converged(machines(fleet, "knobs"), {"mad": 2, "syd": 1}, "4", "v2")
    logs = list((tmp_path / "home").glob("**/deploy-knobs-v4-*.log"))  # -<fleet>: two fleets never share one
    assert logs
    # the background process writes its last line after the release's status (CI84 read the log in between)
    wait_until(lambda: "v4 deployed" in logs[0].read_text(), "the background deploy's log to say v4 deployed", 30)
    assert spares(machines(fleet, "knobs")) == []
    destroy(fleet, "knobs")


def test_a_worker_refuses_a_workdir_it_does_not_have(fleet: DevFleet, tmp_path: Path) -> None:
    async def go() -> tuple[int, object, int, object]:
        nc = await connect_nats(fleet.url)
        try:
            subject = "fauxmad.v1.api.apps.nodir.machines.create"
            answers = []
            for workdir in (str(tmp_path / "gone"), "relative/dir"):
                body = {"region": "mad", "config": {"cmd": ["true"], "workdir": workdir}}
                msg = await nc.request(subject, json.dumps(body).encode(), timeout=10)
                answers += [int((msg.headers or {}).get("Nats-Service-Error-Code", 200)), json.loads(msg.data)]
            return answers[0], answers[1], answers[2], answers[3]
        finally:
            await nc.close()

    missing, why, relative, how = arun(go())
    assert missing == 400 and f"{tmp_path / 'gone'} is not a directory on worker mad-w" in str(why), why
    assert relative == 400 and "workdir must be an absolute path" in str(how), how
    assert machines(fleet, "nodir") == []
