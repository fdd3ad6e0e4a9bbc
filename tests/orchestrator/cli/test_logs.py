"""Machine logs: the worker's follower (unit), stream FAUXMAD_LOGS, and `fauxmad logs` / `machine logs`
against a real fleet (nats-server, worker processes, machine processes), the CLI run as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import workers.output as worker_logs
from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.fleet import CreateRequest
from bus.contract.machines import MachineConfig, RestartPolicy
from bus.contract.streams import LogLine
from bus.local.embedded import EmbeddedNats
from bus.transport.jetstream import LOGS_MAX_MSG_SIZE, FleetConfig, ensure_fleet_resources, logs_limits
from orchestrator.cli.app import main
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.logs import LogQuery, read_logs
from tests.helpers import ROOT, Output, arun, connect_nats, fleet_fixture
from tests.helpers import fauxmad as run_fauxmad
from workers.output import MAX_LINE, OFFSETS_FILE, LogFollower

# ---------------------------------------------------------------------------------------------------
# the worker's follower, on files


class Sink:
    def __init__(self) -> None:
        self.lines: list[LogLine] = []
        self.fail_at: int | None = None  # raise on this publish (0-based, counting every attempt)
        self.attempts = 0

    async def publish(self, line: LogLine) -> None:
        attempt = self.attempts
        self.attempts += 1
        if self.fail_at is not None and attempt == self.fail_at:
            raise ConnectionError("bus gone")
        self.lines.append(line)

    def texts(self, stream: str | None = None) -> list[str]:
        return [line.line for line in self.lines if stream is None or line.stream == stream]


def follower(sink: Sink, connected: list[bool] | None = None) -> LogFollower:
    state = connected if connected is not None else [True]
    return LogFollower(sink.publish, region="mad", worker_id="w1", connected=lambda: state[0])


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as handle:
        handle.write(data)


def test_follower_clips_long_lines_and_publishes_the_last_line_of_a_stopped_machine(tmp_path: Path) -> None:
    sink = Sink()
    logs = follower(sink)
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    append(out, b"before\n")  # written before the machine is followed: not published
    logs.follow("m1", "web", tmp_path, from_offset_now=True)
    long_line = "é" * (MAX_LINE // 2 + 10)  # 2 bytes a character: the clip falls inside one
    append(out, b"[info] hello\n" + long_line.encode() + b"\nhalf")
    append(err, b"oops [/x] there\n")
    arun(logs.tick())
    assert sink.texts("stdout")[0] == "[info] hello"
    clipped = sink.texts("stdout")[1]
    assert clipped.startswith("é" * (MAX_LINE // 2)) and clipped.endswith("… [clipped 20 bytes]")
    assert len(clipped.split("…")[0].encode()) == MAX_LINE
    assert sink.texts("stderr") == ["oops [/x] there"]
    assert {(line.region, line.worker_id, line.app, line.machine_id) for line in sink.lines} == {
        ("mad", "w1", "web", "m1")
    }
    append(out, b" a line\nno newline at exit")
    logs.unfollow("m1")  # the machine stopped: what it wrote is still published, the last line too
    arun(logs.tick())
    assert sink.texts("stdout")[2:] == ["half a line", "no newline at exit"]
    assert logs.following() == []
    assert json.loads((tmp_path / OFFSETS_FILE).read_text()) == {
        "stdout": out.stat().st_size,
        "stderr": err.stat().st_size,
    }


def test_follower_waits_for_the_bus_and_republishes_from_a_failed_line(tmp_path: Path) -> None:
    sink, connected = Sink(), [False]
    logs = follower(sink, connected)
    logs.follow("m1", "web", tmp_path, from_offset_now=True)
    append(tmp_path / "stdout.log", b"".join(f"line-{i}\n".encode() for i in range(5)))
    assert arun(logs.tick()) == 0 and sink.lines == []  # bus down: the lines wait in the file
    connected[0] = True
    sink.fail_at = 2
    arun(logs.tick())  # line-2 fails: back to it
    assert sink.texts() == ["line-0", "line-1"]
    arun(logs.tick())
    assert sink.texts() == [f"line-{i}" for i in range(5)]  # nothing lost, nothing twice


def test_follower_resumes_where_it_stopped_and_bounds_the_backlog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = Sink()
    logs = follower(sink)
    out = tmp_path / "stdout.log"
    logs.follow("m1", "web", tmp_path, from_offset_now=True)
    append(out, b"one\ntwo\n")
    arun(logs.tick())
    monkeypatch.setattr(worker_logs, "SAVE_EVERY", 0.0)
    append(out, b"three\n")
    arun(logs.tick())  # saves where it is
    append(out, b"written while the worker was down\n")
    again = follower(sink)  # a restarted worker: carries on from the saved offsets
    again.follow("m1", "web", tmp_path, from_offset_now=True)
    arun(again.tick())
    assert sink.texts() == ["one", "two", "three", "written while the worker was down"]
    monkeypatch.setattr(worker_logs, "MAX_BACKLOG", 100)
    append(out, b"x" * 500 + b"\n" + b"".join(f"tail-{i}\n".encode() for i in range(10)))
    sink.lines.clear()
    arun(again.tick())
    texts = sink.texts()
    assert texts[0].startswith("[fauxmad] skipped ") and texts[0].endswith(" bytes of stdout")
    assert texts[-1] == "tail-9" and all(t.startswith("tail-") for t in texts[1:])  # cut to the next newline
    assert sum(len(t) + 1 for t in texts[1:]) <= 100


# ---------------------------------------------------------------------------------------------------
# the stream


def test_logs_stream_limits_are_configuration(fresh_nats: EmbeddedNats, monkeypatch: pytest.MonkeyPatch) -> None:
    async def stream(config: FleetConfig) -> tuple[float, int, int]:
        nc = await connect_nats(fresh_nats.url)
        js = nc.jetstream()
        await ensure_fleet_resources(js, config)
        info = (await js.stream_info(subjects.LOGS_STREAM)).config
        await nc.close()
        assert info.subjects == ["fauxmad.v1.logs.>"]
        return info.max_age or 0.0, info.max_bytes or 0, info.max_msg_size or 0

    assert arun(stream(FleetConfig())) == (86400.0, 256 << 20, LOGS_MAX_MSG_SIZE)  # the defaults
    monkeypatch.setenv("FAUXMAD_LOGS_MAX_AGE", "2h")
    monkeypatch.setenv("FAUXMAD_LOGS_MAX_BYTES", "64MiB")
    assert arun(stream(FleetConfig())) == (7200.0, 64 << 20, LOGS_MAX_MSG_SIZE)  # applied to the stream there
    assert arun(stream(FleetConfig(logs_max_age=600.0))) == (600.0, 64 << 20, LOGS_MAX_MSG_SIZE)
    monkeypatch.delenv("FAUXMAD_LOGS_MAX_AGE")
    monkeypatch.delenv("FAUXMAD_LOGS_MAX_BYTES")
    assert arun(stream(FleetConfig())) == (600.0, 64 << 20, LOGS_MAX_MSG_SIZE)  # not given: kept
    with pytest.raises(ValueError, match="logs stream limits"):
        logs_limits(FleetConfig(), {"FAUXMAD_LOGS_MAX_BYTES": "lots"})
    # the biggest line a worker sends, all of it escaped by JSON, fits a message
    worst = LogLine(machine_id="0" * 14, app="a" * 64, stream="stderr", line="\x1b" * MAX_LINE, timestamp=1.0)
    assert len(encode(worst)) < LOGS_MAX_MSG_SIZE - 1024
    assert subjects.logs_filter("web") == "fauxmad.v1.logs.web.*"
    assert subjects.logs_filter("web", "0123456789abcd") == "fauxmad.v1.logs.web.0123456789abcd"


# ---------------------------------------------------------------------------------------------------
# a real fleet and the CLI

SCRIPT = (
    "printf '[info] hello\\noops [/x] there\\n[bold]not bold[/bold] \\\\[escaped]\\n'; "
    "echo 'err [red]line[/red]' >&2; printf 'last line, no newline'"
)
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


fleet = fleet_fixture(FleetSpec(regions=["mad", "syd"], workers_per_region=1, cpus=4, memory_mb=4096, brokers=1))


def fauxmad(fleet: DevFleet, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_fauxmad(*args, url=fleet.url, columns=100, timeout=timeout)


def cli_env(fleet: DevFleet) -> dict[str, str]:
    return dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT), COLUMNS="100")


def run_machine(fleet: DevFleet, app: str, region: str, script: str) -> str:
    """Create and start a machine through the brokers (`restart: no`: it runs the script once)."""

    async def create() -> str:
        client = await FleetClient.connect(fleet.url)
        try:
            config = MachineConfig(cmd=["sh", "-c", script], restart=RestartPolicy(policy="no"))
            return (await client.create(app, CreateRequest(region=region, config=config))).id
        finally:
            await client.close()

    return arun(create())


def in_process(fleet: DevFleet, capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI in this process (quicker than a subprocess for the many filter variants)."""
    capfd.readouterr()
    code = main([*args, "--nats", fleet.url])
    out, err = capfd.readouterr()
    return code, out, err


def wait_for_lines(fleet: DevFleet, app: str, count: int, timeout: float = 20) -> None:
    async def lines() -> int:
        nc = await connect_nats(fleet.url)
        try:
            return await read_logs(nc, LogQuery(app=app), lambda batch: None)
        finally:
            await nc.close()

    deadline = time.monotonic() + timeout
    while arun(lines()) < count and time.monotonic() < deadline:
        time.sleep(0.2)


def test_logs_history_verbatim_with_filters(fleet: DevFleet, capfd: pytest.CaptureFixture[str]) -> None:
    app = "logsapp"
    mad = run_machine(fleet, app, "mad", SCRIPT)
    syd = run_machine(fleet, app, "syd", "echo from-syd")
    wait_for_lines(fleet, app, 6)

    plain = fauxmad(fleet, "logs", "-a", app)  # a real process, its real stdout
    assert plain.returncode == 0, plain.stderr
    mine = [line for line in plain.stdout.splitlines() if f" mad {mad} " in line]
    assert [line.split(" | ", 1)[1] for line in mine if " stdout | " in line] == [
        "[info] hello",
        "oops [/x] there",
        "[bold]not bold[/bold] \\[escaped]",
        "last line, no newline",
    ]
    assert [line.split(" | ", 1)[1] for line in mine if " stderr | " in line] == ["err [red]line[/red]"]
    assert re.fullmatch(rf"{STAMP} mad {mad} stdout \| \[info\] hello", mine[0])
    assert re.fullmatch(
        rf"{STAMP} syd {syd} stdout \| from-syd", next(x for x in plain.stdout.splitlines() if syd in x)
    )

    history = fauxmad(fleet, "machine", "logs", mad, "-a", app, "--no-follow")
    assert history.returncode == 0, history.stderr
    assert history.stdout.splitlines() == mine

    code, out, _ = in_process(fleet, capfd, "logs", "-a", app, "--json")
    found = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(found) == 6
    seqs = [int(line["stream_seq"]) for line in found]
    assert seqs == sorted(seqs) and len(set(seqs)) == 6
    first = next(line for line in found if line["machine_id"] == mad)
    assert {k: first[k] for k in ("app", "region", "stream", "line")} == {
        "app": app,
        "region": "mad",
        "stream": "stdout",
        "line": "[info] hello",
    }
    assert isinstance(first["timestamp"], float) and first["worker_id"]

    def lines(*args: str) -> list[str]:
        code, out, err = in_process(fleet, capfd, "logs", "-a", app, "--json", *args)
        assert code == 0, err
        return [str(json.loads(line)["line"]) for line in out.splitlines()]

    assert lines("--machine", syd) == ["from-syd"]
    assert lines("--region", "syd") == ["from-syd"]
    assert len(lines("--region", "mad")) == 5 and "from-syd" not in lines("--region", "mad")
    code, out, err = in_process(fleet, capfd, "logs", "-a", app, "--region", "gru")  # no worker there: unknown
    assert (code, out) == (4, "") and "no region 'gru': the regions are mad, syd" in err
    assert len(lines("--since", "1h")) == 6
    assert lines("-n", "1") == [found[-1]["line"]]
    assert lines("--machine", mad, "-n", "2") == [line["line"] for line in found if line["machine_id"] == mad][-2:]
    assert lines("--region", "mad", "-n", "3") == [line["line"] for line in found if line["machine_id"] == mad][-3:]
    code, out, err = in_process(fleet, capfd, "logs", "-a", app, "--since", "2999-01-01T00:00:00Z")
    assert code == 0 and out == "" and "no logs for app logsapp since" in err
    code, out, err = in_process(fleet, capfd, "logs", "-a", app, "--since", "soon")
    assert code == 2 and "invalid --since" in err
    code, out, err = in_process(fleet, capfd, "machine", "logs", "0123456789abcd", "-a", app, "--no-follow")
    assert code != 0 and "not found" in err


def test_logs_follow_prints_the_history_then_new_lines(fleet: DevFleet) -> None:
    app = "logsfollow"
    run_machine(fleet, app, "mad", "echo early-line")
    wait_for_lines(fleet, app, 1)
    follow = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "logs", "-a", app, "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        env=cli_env(fleet),
    )
    output = Output(follow.stdout)
    try:
        seen = output.has("early-line")
        assert seen[0].endswith("| early-line")
        late = run_machine(fleet, app, "syd", "echo 'late [info] line'")
        seen = output.has("late [info] line")
        assert seen[-1].endswith(f"syd {late} stdout | late [info] line")
    finally:
        follow.send_signal(signal.SIGINT)
        follow.wait(timeout=10)
    assert len(seen) == 2, seen
