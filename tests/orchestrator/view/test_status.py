"""`fauxmad status`, `status --watch` and `events` against a real fleet: real nats-server, real worker
processes and a broker, the CLI as a subprocess (under a pseudo-terminal for the live view)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import msgspec

from bus.contract import subjects
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, ListRequest, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.view.db import ViewDb
from orchestrator.view.fold import ViewWriter
from orchestrator.view.follower import ViewFollower
from orchestrator.view.query import ViewReader
from tests.helpers import ROOT, Output, arun, fleet_fixture

CLI = [sys.executable, "-m", "orchestrator.cli"]


fleet = fleet_fixture(FleetSpec(regions=["mad", "syd"], workers_per_region=2, cpus=16, heartbeat=0.5))


SLEEP = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=32))


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FAUXMAD_NATS_URL", "COLUMNS", "LINES")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def fauxmad(*args: str, url: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = cli_env(COLUMNS="120", **({"FAUXMAD_NATS_URL": url} if url else {}))
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


async def workers_own_answers(client: FleetClient, worker_ids: list[str], app: str) -> dict[str, tuple[str, str]]:
    """machine id -> (worker, state), asked of every worker directly."""
    out = {}
    for worker_id in worker_ids:
        msg = await client.nc.request(
            subjects.worker_machines(worker_id, "list"), msgspec.json.encode(ListRequest(app=app)), timeout=5
        )
        out.update({m["id"]: (m["worker_id"], m["state"]) for m in msgspec.json.decode(msg.data)})
    return out


def test_status_json_agrees_with_the_workers_after_a_burst_and_a_rebuild_equals_the_incremental_view(
    fleet: DevFleet,
    tmp_path: Path,
) -> None:
    incremental = tmp_path / "incremental.sqlite"

    async def burst() -> tuple[int, dict[str, tuple[str, str]], dict[str, list[tuple[object, ...]]]]:
        client = await FleetClient.connect(fleet.url)
        view = ViewDb(incremental)
        follower = ViewFollower(client.nc, ViewWriter(view))
        await follower.start()  # follows while the burst happens
        labels = {"fauxmad_release": "4", "fauxmad_role": "primary"}
        config = msgspec.structs.replace(SLEEP, metadata=labels)

        async def one(i: int) -> None:
            region = "mad" if i % 2 else "syd"
            machine = await client.create("burst", CreateRequest(region=region, config=config, skip_launch=True))
            for verb in ("start", "stop", "start", "stop", "start")[: 3 + i % 3]:
                await getattr(client, verb)("burst", machine.id)

        await asyncio.gather(*[one(i) for i in range(20)])
        assert await follower.catch_up(20)
        answers = await workers_own_answers(client, fleet.worker_ids, "burst")
        await asyncio.sleep(0.3)  # nothing more is coming: the machines are settled
        assert await follower.catch_up(5)
        applied, dump = follower.applied, ViewReader(view).dump()
        await follower.close()
        view.close()
        await client.close()
        return applied, answers, dump

    applied, answers, incremental_dump = arun(burst())
    transitions = sum(1 for row in incremental_dump["events"] if row[5] == "burst")
    print(f"\nburst: {transitions} events of app burst, {applied} applied by the incremental view")
    assert transitions >= 200 and len(answers) == 20

    scratch = tmp_path / "scratch.sqlite"
    result = fauxmad("status", "--app", "burst", "--json", "--view", str(scratch), url=fleet.url)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert {m["id"]: (m["worker_id"], m["state"]) for m in status["machines"]} == answers
    assert {m["state"] for m in status["machines"]} <= {"started", "stopped"}
    assert all((m["release"], m["role"]) == ("4", "primary") for m in status["machines"])
    assert {w["worker_id"] for w in status["workers"]} == {w for w, _ in answers.values()}
    assert {r["region"] for r in status["regions"]} == {"mad", "syd"}
    assert sum(r["machines"] for r in status["regions"]) == 20
    assert status["view"]["path"] == str(scratch)

    rebuilt = ViewDb(scratch)
    assert ViewReader(rebuilt).dump() == incremental_dump  # built from scratch by the CLI == followed live
    rebuilt.close()
    fleet.destroy_all_machines()


def test_status_tables_unknown_app_and_unreachable_bus(fleet: DevFleet, tmp_path: Path) -> None:
    async def place() -> str:
        client = await FleetClient.connect(fleet.url)
        machine = await client.create("tables", CreateRequest(region="mad", config=SLEEP))
        await client.close()
        return machine.id

    machine_id = arun(place())
    view = str(tmp_path / "view.sqlite")
    result = fauxmad("status", "--view", view, url=fleet.url)
    assert result.returncode == 0, result.stderr
    for needle in ("regions", "workers", "machines", "mad-w1", "syd-w2", "ready", machine_id, "tables", "started"):
        assert needle in result.stdout, needle

    # an app the fleet never knew: exit 4, one line (docs/reference/exit-codes.md, "Unknown names")
    unknown = fauxmad("status", "--app", "never-ran-here", "--json", "--view", view, url=fleet.url)
    assert unknown.returncode == 4 and unknown.stdout == ""
    assert unknown.stderr.startswith("fauxmad: no app 'never-ran-here'") and unknown.stderr.count("\n") == 1
    assert fauxmad("status", "--app", "bad.app", url=fleet.url).returncode == 2

    for args in (["status"], ["status", "--watch"], ["events"]):
        started = time.monotonic()
        down = (
            fauxmad(*args, "--view", view, url="nats://127.0.0.1:1")
            if args[0] == "status"
            else fauxmad(*args, url="nats://127.0.0.1:1")
        )
        elapsed = time.monotonic() - started
        lines = [line for line in down.stderr.splitlines() if line.strip()]
        assert down.returncode == 3 and len(lines) == 1 and "cannot reach NATS" in lines[0], down.stderr
        # the promise is "exit 3 at once" (docs/reference/exit-codes.md): no retry loop. A refused connection is
        # refused in a millisecond; 5 s is the margin for a CLI's start-up on a host running two test files
        assert elapsed < 5, elapsed


def test_events_filters_json_since_and_follow(fleet: DevFleet) -> None:
    async def place() -> tuple[str, str]:
        client = await FleetClient.connect(fleet.url)
        one = await client.create("evts", CreateRequest(region="syd", config=SLEEP))
        two = await client.create("evts", CreateRequest(region="mad", config=SLEEP, skip_launch=True))
        await client.stop("evts", one.id)
        await client.close()
        return one.id, two.id

    one, two = arun(place())
    every = [
        json.loads(line) for line in fauxmad("events", "--app", "evts", "--json", url=fleet.url).stdout.splitlines()
    ]
    assert {e["machine_id"] for e in every} == {one, two} and all(e["app"] == "evts" for e in every)
    seqs = [e["stream_seq"] for e in every]
    assert seqs == sorted(seqs)
    mine = [e for e in every if e["machine_id"] == one]
    assert [e["status"] for e in mine if e["type"] == "transition"] == [
        "created",
        "starting",
        "started",
        "stopping",
        "stopped",
    ]
    assert any(e["type"] == "exit" and e["exit"]["signal"] == signal.SIGTERM for e in mine)  # exits are published
    assert mine[0]["metadata"] == {}
    only = fauxmad("events", "--machine", two, url=fleet.url)
    assert only.returncode == 0 and two in only.stdout and one not in only.stdout and "created" in only.stdout
    assert fauxmad("events", "--app", "evts", "--since", "10m", "--json", url=fleet.url).stdout.count("\n") == len(
        every
    )
    future = fauxmad("events", "--app", "evts", "--since", "2999-01-01T00:00:00Z", url=fleet.url)
    assert future.returncode == 0 and future.stdout == "" and "no events for app evts since" in future.stderr
    nothing = fauxmad("events", "--app", "no-such-app", url=fleet.url)  # an app the fleet never knew: exit 4
    assert nothing.returncode == 4 and nothing.stdout == "" and "no app 'no-such-app'" in nothing.stderr
    bad = fauxmad("events", "--since", "a while", url=fleet.url)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "invalid --since" in bad.stderr

    # from now on: an absolute start, not "1s" before a CLI that may take over a second to start on a busy host
    now = datetime.datetime.now(datetime.UTC).isoformat()
    args = ["events", "--follow", "--json", "--app", "evts", "--since", now, "--nats", fleet.url]
    follow = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=cli_env())
    assert follow.stdout is not None
    try:
        time.sleep(1.5)  # subscribed: the follow has no "ready" line to wait for

        async def start_two() -> None:
            client = await FleetClient.connect(fleet.url)
            await client.start("evts", two)
            await client.close()

        arun(start_two())
        lines = Output(follow.stdout).has('"status":"started"', "the started event", timeout=10)
        seen = [json.loads(line) for line in lines]
        got = [(e["machine_id"], e["type"], e["status"]) for e in seen]
        assert got == [(two, "transition", "starting"), (two, "transition", "started")], got
    finally:
        follow.send_signal(signal.SIGINT)
        follow.wait(timeout=10)
    assert follow.returncode == 0 and b"Traceback" not in (follow.stderr.read() if follow.stderr else b"")
    fleet.destroy_all_machines()


# ---------------------------------------------------------------------------------------------------
# the live view, as a person runs it: a subprocess on a pseudo-terminal 80 columns by 40 rows


class Terminal:
    def __init__(self, args: list[str], columns: int = 80, rows: int = 40) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.before = termios.tcgetattr(slave)
        self.slave = slave

        def controlling_tty() -> None:  # a session of its own, with this pty as its terminal: Ctrl-C works
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = cli_env(TERM="xterm-256color")
        self.proc = subprocess.Popen(
            [*CLI, *args], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT, preexec_fn=controlling_tty
        )
        self.output = b""

    def read(self, timeout: float) -> None:
        if select.select([self.master], [], [], timeout)[0]:
            with contextlib.suppress(OSError):  # EIO once the child has exited
                self.output += os.read(self.master, 65536)

    def wait_for(self, needle: bytes, timeout: float, since: int = 0) -> float | None:
        """The moment (monotonic) `needle` showed in the output after offset `since`, or None."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.output[since:]:
                return time.monotonic()
            self.read(0.01)
        return None

    def finish(self, key: bytes) -> int:
        os.write(self.master, key)
        deadline = time.monotonic() + 15
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.05)
        code = self.proc.wait(timeout=5)
        self.read(0.1)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


def test_the_live_view_renders_follows_events_within_a_second_and_quits(fleet: DevFleet, tmp_path: Path) -> None:
    term = Terminal(["status", "--watch", "--view", str(tmp_path / "live.sqlite"), "--nats", fleet.url])
    try:
        assert term.wait_for(b"recent events", 20) is not None, term.output[-2000:]
        assert term.wait_for(b"mad-w1", 5) is not None and term.wait_for(b"syd-w2", 5) is not None

        async def create() -> tuple[str, float]:
            client = await FleetClient.connect(fleet.url)
            machine = await client.create("livetest", CreateRequest(region="syd", config=SLEEP, skip_launch=True))
            placed = time.monotonic()
            await client.close()
            return machine.id, placed

        mark = len(term.output)
        machine_id, placed = arun(create())
        # the event: the machine comes onto the screen with no key pressed (a frozen or key-driven view would never
        # show it); how soon is a figure, printed, not a check (20 s bounds only a view that never updates)
        seen = term.wait_for(machine_id.encode(), 20, since=mark)
        assert seen is not None, term.output[-3000:]
        latency = seen - placed  # from the create's reply (the event is published by then) to the screen
        print(f"\nlive view: machine {machine_id} on screen {latency * 1000:.0f} ms after its create returned")
        assert b"livetest" in term.output[mark:]
        assert term.finish(b"q") == 0
        assert b"Traceback" not in term.output
        assert termios.tcgetattr(term.slave) == term.before  # cbreak undone: the terminal is as it was
    finally:
        term.close()
    fleet.destroy_all_machines()


def test_the_live_view_exits_cleanly_on_ctrl_c(fleet: DevFleet, tmp_path: Path) -> None:
    term = Terminal(["status", "--watch", "--view", str(tmp_path / "live.sqlite"), "--nats", fleet.url], columns=100)
    try:
        assert term.wait_for(b"recent events", 20) is not None, term.output[-2000:]
        assert term.finish(b"\x03") in (0, 130)
        assert b"Traceback" not in term.output
        assert termios.tcgetattr(term.slave) == term.before
    finally:
        term.close()
