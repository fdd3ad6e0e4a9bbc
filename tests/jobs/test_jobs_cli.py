"""`fauxmad job ...`, `status` and `events --jobs` as a user runs them (real processes throughout)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.helpers import fauxmad


def cli(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return fauxmad(*args, url=url, env={"FAUXMAD_VIEW": str(tmp_path / "view.sqlite")})


def test_the_job_commands(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=2)
    done = cli(
        nats_url,
        tmp_path,
        "job",
        "submit",
        "-a",
        app,
        "-r",
        region,
        "--count",
        "2",
        "--wait",
        "--json",
        "--",
        "sh",
        "-c",
        "echo hello $FAUXMAD_JOB_ATTEMPT",
    )
    assert done.returncode == 0, done.stderr
    jobs = json.loads(done.stdout)
    assert [job["state"] for job in jobs] == ["succeeded", "succeeded"]
    job_id = jobs[0]["id"]
    logs = cli(nats_url, tmp_path, "job", "logs", job_id, "-a", app)
    assert logs.returncode == 0 and logs.stdout == "hello 1\n"
    status = cli(nats_url, tmp_path, "job", "status", job_id, "-a", app)
    assert status.returncode == 0 and "succeeded" in status.stdout and "attempt 1: succeeded" in status.stdout
    listed = json.loads(cli(nats_url, tmp_path, "job", "list", "-a", app, "--json").stdout)
    assert {job["id"] for job in listed} == {job["id"] for job in jobs}
    failing = cli(
        nats_url, tmp_path, "job", "submit", "-a", app, "-r", region, "--max-attempts", "1", "--wait", "--", "false"
    )
    assert failing.returncode == 1 and "failed" in failing.stdout
    fleet = json.loads(cli(nats_url, tmp_path, "status", "--app", app, "--json").stdout)
    assert {(c["state"], c["count"]) for c in fleet["jobs"]} == {("succeeded", 2), ("failed", 1)}
    events = cli(nats_url, tmp_path, "events", "--jobs", "-a", app, "--json")
    states = [json.loads(line)["state"] for line in events.stdout.splitlines()]
    assert states.count("queued") == 3 and states.count("succeeded") == 2 and states.count("failed") == 1
    slow = cli(nats_url, tmp_path, "job", "submit", "-a", app, "-r", region, "--", "sleep", "30").stdout.strip()
    late = cli(nats_url, tmp_path, "job", "wait", slow, "-a", app, "--timeout", "1")
    assert late.returncode != 0 and late.stderr.count("\n") == 1, late.stderr
    assert "1 of 1 jobs not finished within 1s" in late.stderr
    for _ in range(100):  # its machine runs (the id is in the record) before the cancel
        if json.loads(cli(nats_url, tmp_path, "job", "status", slow, "-a", app, "--json").stdout)["machine_id"]:
            break
    assert cli(nats_url, tmp_path, "job", "cancel", slow, "-a", app).returncode == 0
    assert cli(nats_url, tmp_path, "job", "wait", slow, "-a", app, "--timeout", "30").returncode == 1
    # its events in order: running (claimed), running (its machine's id), the cancel, cancelled; never a
    # `running` after the cancel (its machine's id was announced when the run ended, after the cancel's event)
    lines = cli(nats_url, tmp_path, "events", "--jobs", "-a", app, "--json").stdout.splitlines()
    mine = [(e["state"], e["reason"]) for e in map(json.loads, lines) if e["id"] == slow]
    asked = mine.index(("running", "cancel requested"))
    assert [state for state, _ in mine[asked + 1 :]] == ["cancelled"], mine
    assert [state for state, _ in mine[:asked]] == ["queued", "running", "running"], mine
    shown = cli(nats_url, tmp_path, "events", "--jobs", "-a", app).stdout.splitlines()
    assert sum(slow in line and "running" in line for line in shown) == 3, shown  # the cancel's is one of them


def test_bad_job_arguments_are_one_line_and_exit_2(nats_url: str, tmp_path: Path) -> None:
    for args in (
        ["job", "submit", "-a", "x", "--", "true"],  # no region
        ["job", "submit", "-a", "x y", "-r", "mad", "--", "true"],
        ["job", "submit", "-a", "x", "-r", "mad", "--timeout", "soon", "--", "true"],
        ["job", "submit", "-a", "x", "-r", "mad", "--runner", "vm", "--", "true"],
        ["job", "list", "-a", "x", "--state", "sleeping"],
    ):
        done = cli(nats_url, tmp_path, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith("fauxmad: ") and len(done.stderr.strip().splitlines()) == 1, done.stderr
