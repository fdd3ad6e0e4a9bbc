"""The CLI, through typer's runner and as real subprocesses: help, JSON, one-line errors, `dev` cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bus.local.ports import free_port
from orchestrator.cli.app import COMMANDS, app, main, register
from orchestrator.devfleet import DevFleet, FleetSpec
from tests import helpers
from tests.helpers import ROOT, Output, fleet_fixture

runner = CliRunner()


def fauxmad(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return helpers.fauxmad(*args, columns=100, timeout=timeout, env=env, drop=["FAUXMAD_NATS_URL"])


fleet = fleet_fixture(FleetSpec(regions=["ams", "sin"], workers_per_region=2, cpus=2, memory_mb=2048))


def test_help_explains_every_command() -> None:
    register()  # main registers only the command it runs, or all of them for the root's help
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("demo", "dev", "machine", "workers", "regions", "worker", "broker", "bench"):
        assert command in result.output
    assert main(["machine", "run", "--help"]) == 0


@pytest.mark.fleet
def test_every_command_imports_on_its_own_in_a_fresh_interpreter() -> None:
    """`main` imports only the module of the command it runs; the suite's other commands are forks of a process that
    imported them all (`tests.cli_fork`), where one module's missing import can go unseen behind another's."""
    for name, *_ in COMMANDS:
        done = helpers.fauxmad(name, "--help", columns=100, fresh=True, timeout=60)
        assert done.returncode == 0 and "Usage" in done.stdout, (name, done.stdout + done.stderr)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["workers", "--bogus"], "No such option: --bogus"),
        (["machine", "run", "--app", "a", "--region", "r", "--cpus", "0", "--", "true"], "--cpus"),
        (["workers"], "no NATS server given"),
        (["workers", "--nats", "nats://127.0.0.1:1"], "cannot reach NATS at nats://127.0.0.1:1"),
        (["dev", "--regions", "bad.region"], "invalid region"),
        (["bench", "placement", "--strategy", "random"], "unknown --strategy"),
        (["nonsense"], "No such command"),
        (["worker", "--machine-ports", "300-200"], "--machine-ports: '300-200': ports go from 1 to 65535"),
    ],
)
def test_errors_are_one_plain_line_and_a_nonzero_exit(args: list[str], needle: str) -> None:
    result = fauxmad(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_machine_commands_against_a_fleet(fleet: DevFleet) -> None:
    env = {"FAUXMAD_NATS_URL": fleet.url}
    run = fauxmad(
        "machine",
        "run",
        "--app",
        "clitest",
        "--region",
        "sin",
        "--memory-mb",
        "64",
        "--env",
        "A=1",
        "--explain",
        "--json",
        "--",
        "sleep",
        "60",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    machine = json.loads(run.stdout)
    assert machine["state"] == "started" and machine["region"] == "sin" and machine["config"]["env"] == {"A": "1"}
    assert machine["explain"]["winner"] == machine["worker_id"]
    listed = json.loads(fauxmad("machine", "list", "--app", "clitest", "--json", env=env).stdout)
    assert [m["id"] for m in listed] == [machine["id"]]
    shown = fauxmad("machine", "show", machine["id"], "--app", "clitest", env=env)
    assert shown.returncode == 0 and machine["id"] in shown.stdout and "started" in shown.stdout
    workers = json.loads(fauxmad("workers", "--json", env=env).stdout)
    assert {w["worker_id"] for w in workers} == {"ams-w1", "ams-w2", "sin-w1", "sin-w2"}
    regions = json.loads(fauxmad("regions", "--json", env=env).stdout)
    assert [r["region"] for r in regions] == ["ams", "sin"]
    table = fauxmad("workers", env=env)
    assert "sin-w1" in table.stdout
    refused = fauxmad("machine", "run", "--app", "clitest", "--region", "sin", "--cpus", "64", "--", "true", env=env)
    assert refused.returncode == 1 and "no capacity in sin" in refused.stderr
    destroy = fauxmad("machine", "destroy", machine["id"], "--app", "clitest", env=env)
    assert destroy.returncode == 5 and "stop it first" in destroy.stderr  # 409: a conflict
    assert fauxmad("machine", "stop", machine["id"], "--app", "clitest", env=env).returncode == 0
    assert "destroyed" in fauxmad("machine", "destroy", machine["id"], "--app", "clitest", env=env).stdout
    missing = fauxmad("machine", "show", "0123456789abcd", "--app", "clitest", env=env)
    assert missing.returncode == 4 and "not found" in missing.stderr


def test_machine_logs_follow_output(fleet: DevFleet) -> None:

    env = {"FAUXMAD_NATS_URL": fleet.url}
    machine = json.loads(
        fauxmad(
            "machine",
            "run",
            "--app",
            "logs",
            "--region",
            "ams",
            "--json",
            "--",
            "sh",
            "-c",
            "i=0; while true; do i=$((i+1)); echo tick-$i; echo warn-$i >&2; sleep 0.2; done",
            env=env,
        ).stdout
    )
    follow = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "machine", "logs", machine["id"], "--app", "logs", "--json", "-f"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
    )
    try:
        lines = Output(follow.stdout).until(lambda lines: len(lines) >= 6, "six lines of the machine's output")
        seen: list[dict[str, str]] = [json.loads(line) for line in lines]
    finally:
        follow.send_signal(signal.SIGINT)
        follow.wait(timeout=10)
    ticks = [int(e["line"].split("-")[1]) for e in seen if e["stream"] == "stdout"]
    assert len(ticks) >= 2 and ticks == sorted(ticks) and ticks[-1] - ticks[0] == len(ticks) - 1
    assert any(e["stream"] == "stderr" and e["line"].startswith("warn-") for e in seen)
    missing = fauxmad("machine", "logs", "0123456789abcd", "--app", "logs", env=env)
    assert missing.returncode == 4 and "not found" in missing.stderr


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            blob = (entry / "cmdline").read_bytes() + b"\0" + (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text.encode() in blob and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.fleet  # starts processes of its own
def test_dev_leaves_no_process_after_ctrl_c() -> None:
    port = free_port()
    dev = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "dev",
            "--regions",
            "xa,xb",
            "--workers-per-region",
            "2",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"},
    )
    output = "\n".join(Output(dev.stdout).has("fleet up", "the dev fleet up", timeout=60))
    assert f"127.0.0.1:{port}" in output
    url = f"nats://127.0.0.1:{port}"
    run = fauxmad(
        "machine",
        "run",
        "--app",
        "devclean",
        "--region",
        "xb",
        "--json",
        "--",
        "sleep",
        "300",
        env={"FAUXMAD_NATS_URL": url},
    )
    assert run.returncode == 0, run.stderr
    assert _processes_mentioning("FAUXMAD_APP=devclean")
    assert _processes_mentioning(f"127.0.0.1:{port}")
    dev.send_signal(signal.SIGINT)
    rest, _ = dev.communicate(timeout=60)
    assert dev.returncode == 0, rest
    assert "nothing left running" in rest
    assert _processes_mentioning("FAUXMAD_APP=devclean") == []
    assert _processes_mentioning(f"127.0.0.1:{port}") == []


# every group that prints its help when bare (`worker` runs a worker; `schema` asks for its command)
BARE_HELP = ["", *(name for name, _, _, group in COMMANDS if group and name not in ("worker", "schema"))]


@pytest.mark.parametrize("group", BARE_HELP)
def test_a_bare_group_prints_its_help_once(group: str) -> None:
    """`fauxmad`, `fauxmad apps`, ... print one `Usage:` block, exit 0 (issue 41: two, 27 lines for `apps`)."""
    result = fauxmad(*filter(None, [group]))
    assert result.returncode == 0, result.stderr
    assert (result.stdout + result.stderr).count("Usage:") == 1, result.stdout + result.stderr
