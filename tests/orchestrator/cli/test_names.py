"""One check of names at every CLI edge: a bad app, region, machine id or worker id is one line, exit 2.

The names come from issue 9: `'a b'` and `'*'` used to reach KV and end as `InvalidKeyError()` (exit
70), and `sandwich.x` was accepted. Each command gets a real nats-server URL, so a name that slipped
past the check would reach the fleet and fail differently.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.contract import subjects
from bus.contract.errors import BadRequest
from orchestrator.cli.app import main
from tests.helpers import ROOT

BAD = ["a b", "*", "sandwich.x", ">", "a\n", "x" * 65, ""]
ID = "0123456789abcd"


def expected(kind: str, name: str) -> str:
    return f"fauxmad: invalid {kind} {name!r}: use 1-64 letters, digits, '-' or '_'"


def edges(name: str) -> Iterator[tuple[str, list[str]]]:
    """(kind, argv) for every place a CLI command takes a name, with `name` put there."""
    for argv in (
        ["releases", "--app", name],
        ["rollback", "--app", name],
        ["rollback", "2", "-a", name],
        ["scale", "count", "1", "--app", name],
        ["apps", "destroy", name, "--yes"],
        ["apps", "destroy", name],
        ["machine", "list", "--app", name],
        ["machine", "show", ID, "--app", name],
        ["machine", "run", "--app", name, "--region", "mad", "--", "true"],
        ["machine", "start", ID, "-a", name],
        ["machine", "stop", ID, "-a", name],
        ["machine", "destroy", ID, "-a", name],
        ["machine", "wait", ID, "-a", name],
        ["machine", "logs", ID, "-a", name],
        ["status", "--app", name],
        ["events", "--app", name],
        ["reconcile", "--app", name],
    ):
        yield "app", argv
    for argv in (
        ["machine", "show", name, "--app", "ok"],
        ["machine", "stop", name, "--app", "ok"],
        ["machine", "wait", name, "--app", "ok"],
        ["machine", "logs", name, "--app", "ok"],
        ["events", "--machine", name],
    ):
        yield "machine id", argv
    for argv in (
        ["workers", "--region", name],
        ["machine", "run", "-a", "ok", "-r", name, "--", "true"],
        ["scale", "count", "1", "-a", "ok", "--region", name],
        ["scale", "count", "1", "-a", "ok", "-r", f"mad,{name}"],
        # a usage error after the name: should the name pass, nothing starts
        ["worker", "--region", name, "--cpus", "0"],
        ["dev", "--regions", f"mad,{name}", "--cpus", "0"],
        ["demo", "--regions", name, "--workers-per-region", "0"],
    ):
        # comma lists skip empty items and trim blanks ("mad, syd"): only the bare --region sees those names
        if name.strip() == name != "" or argv[0] not in ("scale", "dev", "demo"):
            yield "region", argv
    for argv in (
        ["worker", "drain", name],
        ["worker", "cordon", name],
        ["worker", "uncordon", name],
        ["worker", "--worker-id", name, "--cpus", "0"],
    ):
        yield "worker id", argv


def test_check_token_is_the_one_rule() -> None:
    assert subjects.check_token("app", "web-1_A") == "web-1_A"
    for name in BAD:
        with pytest.raises(BadRequest) as caught:
            subjects.check_token("app", name)
        assert f"fauxmad: {caught.value.message}" == expected("app", name)


@pytest.mark.parametrize("name", BAD, ids=repr)
def test_every_edge_refuses_a_bad_name_in_process(
    name: str, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("FAUXMAD_NATS_URL", nats_url)
    for kind, argv in edges(name):
        code = main(argv)
        out, err = capsys.readouterr()
        assert (code, err) == (2, expected(kind, name) + "\n"), (argv, code, out, err)


# the commands of issue 9, as real processes against a real nats-server
ISSUE = [
    ("app", ["releases", "--app"]),
    ("app", ["rollback", "--app"]),
    ("app", ["scale", "count", "2", "--app"]),
    ("app", ["apps", "destroy", "--yes"]),
    ("app", ["machine", "list", "--app"]),
    ("app", ["machine", "show", ID, "--app"]),
    ("machine id", ["machine", "show", "--app", "ok"]),
    ("app", ["status", "--app"]),
    ("app", ["events", "--app"]),
    ("machine id", ["events", "--machine"]),
    ("region", ["scale", "count", "2", "--app", "ok", "--region"]),
    ("worker id", ["worker", "cordon"]),
]


@pytest.mark.parametrize(("kind", "argv"), ISSUE, ids=[" ".join(argv) for _, argv in ISSUE])
def test_issue_commands_as_processes(kind: str, argv: list[str], nats_url: str, tmp_path: Path) -> None:
    names = ["a b", "*", "sandwich.x", ">"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path), "COLUMNS": "100"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", *argv, name, "--nats", nats_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
            env=env,
        )
        for name in names
    ]
    for name, proc in zip(names, procs, strict=True):
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, err) == (2, expected(kind, name) + "\n"), (argv, name, out, err)


def test_a_spec_names_are_checked_the_same_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the spec's own pattern lets a trailing newline through (`$`); the CLI edge does not
    path = tmp_path / "fauxmad.toml"
    for kind, name, table in (
        ("app", "a\n", 'app = "a\\n"\n[regions]\nmad = 1\n'),
        ("region", "mad\n", 'app = "ok"\n[regions]\n"mad\\n" = 1\n'),
    ):
        path.write_text(f'cmd = ["true"]\n{table}')
        assert main(["deploy", "-c", str(path), "--nats", "nats://127.0.0.1:1"]) == 2
        message = expected(kind, name).removeprefix("fauxmad: ")
        assert capsys.readouterr().err == f"fauxmad: {path}: {message}\n"
