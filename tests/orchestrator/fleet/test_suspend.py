"""Suspend and resume: a started machine's process group frozen (SIGSTOP) and continued (SIGCONT), as
worker lifecycle states with events, through the brokers, across a kill -9 of the worker.

Real parts: a dev fleet (nats-server, a worker and a broker process) and a machine that appends a line
to a file every 20 ms, so "frozen" is what the file shows: it stops growing, and grows again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.contract.errors import Conflict
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT, arun, fleet_fixture

APP = "frost"


fleet = fleet_fixture(FleetSpec(regions=["sus"], workers_per_region=1, cpus=4, memory_mb=2048))


def grows(path: Path, within: float = 0.4) -> bool:
    before = path.stat().st_size
    time.sleep(within)
    return path.stat().st_size > before


def test_suspend_freezes_resume_continues_and_both_survive_a_worker_kill(fleet: DevFleet, tmp_path: Path) -> None:
    out = tmp_path / "ticks"
    script = f"while true; do echo tick >> {out}; sleep 0.02; done"
    config = MachineConfig(cmd=["sh", "-c", script], guest=Guest(cpus=1, memory_mb=64))

    async def call(verb: str, machine_id: str) -> str:
        client = await FleetClient.connect(fleet.url)
        try:
            return str((await getattr(client, verb)(APP, machine_id)).state)
        finally:
            await client.close()

    async def resume_then_read(machine_id: str) -> tuple[str, str, list[str]]:
        """A resume, then at once a get and a list: reads show what the resume answered (its record is
        made after the answer)."""
        client = await FleetClient.connect(fleet.url)
        try:
            resumed = await client.resume(APP, machine_id)
            got = await client.get(APP, machine_id)
            listed = [m.state for m in await client.list(APP) if m.id == machine_id]
            return resumed.state, got.state, listed
        finally:
            await client.close()

    async def create() -> str:
        client = await FleetClient.connect(fleet.url)
        try:
            return (await client.create(APP, CreateRequest(region="sus", config=config))).id
        finally:
            await client.close()

    machine_id = arun(create())
    deadline = time.monotonic() + 10
    while not out.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert grows(out)

    assert arun(call("suspend", machine_id)) == "suspended"
    time.sleep(0.1)  # a line being written as it froze
    assert not grows(out)
    assert arun(call("suspend", machine_id)) == "suspended"  # again: nothing to do
    with pytest.raises(Conflict):  # exec needs a started machine
        arun(_exec_on(fleet, machine_id))

    # the worker dies while the machine is suspended: it is still suspended (and frozen) after the restart
    fleet.kill(f"worker-{fleet.worker_ids[0]}")
    fleet.respawn(f"worker-{fleet.worker_ids[0]}")
    deadline = time.monotonic() + 20
    while True:
        try:
            state = arun(call("get", machine_id))
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert state == "suspended" and not grows(out)

    started = time.perf_counter()
    assert arun(resume_then_read(machine_id)) == ("started", "started", ["started"])
    took = time.perf_counter() - started
    assert grows(out)
    print(
        f"\nresume, get and list through broker and worker (a CLI-sized client, connect included): {took * 1000:.1f} ms"
    )

    # a suspended machine stops like a started one (its stop signal is not left waiting in a frozen process)
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "orchestrator.cli", "machine", "suspend", machine_id, "-a", APP, "--json"]
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["state"] == "suspended", done.stderr
    assert arun(call("stop", machine_id)) == "stopped"
    events = arun(_events(fleet, machine_id))
    assert [e for e in events if e in ("suspending", "suspended", "started", "stopping", "stopped")][-7:] == [
        "suspending",
        "suspended",
        "started",
        "suspending",
        "suspended",
        "stopping",
        "stopped",
    ]


async def _exec_on(fleet: DevFleet, machine_id: str) -> None:
    client = await FleetClient.connect(fleet.url)
    try:
        await client.exec(APP, machine_id, ["true"])
    finally:
        await client.close()


async def _events(fleet: DevFleet, machine_id: str) -> list[str]:
    client = await FleetClient.connect(fleet.url)
    try:
        machine = await client.get(APP, machine_id)
        return [e.status for e in reversed(machine.events) if e.type == "transition"]  # oldest first
    finally:
        await client.close()


def test_a_suspended_machine_continued_while_its_worker_was_down_is_recorded_started(
    fleet: DevFleet, tmp_path: Path
) -> None:
    """What a worker killed between a resume's answer and its record finds: `suspended` in its log, a process
    that runs. The process's word wins (the caller was told `started`): recorded `started`, not frozen again."""
    out = tmp_path / "ticks"
    script = f"while true; do echo tick >> {out}; sleep 0.02; done"
    config = MachineConfig(cmd=["sh", "-c", script], guest=Guest(cpus=1, memory_mb=64))

    async def call(verb: str, *args: object, **options: object) -> object:
        client = await FleetClient.connect(fleet.url)
        try:
            return await getattr(client, verb)(APP, *args, **options)
        finally:
            await client.close()

    machine_id = arun(call("create", CreateRequest(region="sus", config=config))).id  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while not out.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert arun(call("suspend", machine_id)).state == "suspended" and not grows(out)  # type: ignore[attr-defined]

    worker = f"worker-{fleet.worker_ids[0]}"
    fleet.kill(worker)
    leader = int(
        subprocess.run(["pgrep", "-f", f"echo tick >> {out}"], capture_output=True, text=True).stdout.split()[0]
    )
    os.killpg(os.getpgid(leader), 18)  # SIGCONT, as the resume did before the worker died
    assert grows(out)
    fleet.respawn(worker)
    deadline = time.monotonic() + 20
    while True:
        try:
            state = arun(call("get", machine_id, events=False)).state  # type: ignore[attr-defined]
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert state == "started" and grows(out)  # not frozen again
    assert arun(call("stop", machine_id)).state == "stopped"  # type: ignore[attr-defined]
