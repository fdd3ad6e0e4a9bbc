"""Two dev fleets on one box never touch each other: what a team's CI and two developers on one machine do,
and what the suite does when it runs two files at a time.

What a fleet puts on its host, and what keeps each one its own (docs/explanation/faults.md, "Two fleets on
one host"): its directory (`tempfile.mkdtemp`), its ports (random picks that bind, in a slice of its own
under `$FAUXMAD_PORT_RANGE`; each worker's machines in a slice of their own), its cgroup subtree (`fauxmad/<worker>-<digest of its data directory>`), its
machines' processes (found as strays by their random machine id, and killed at the fleet's stop by the
pid files under its own directory), its view cache (a file per NATS URL) and a detached deploy's log
(a file per app, release and NATS URL). Worker ids (`mad-w1`) and app names are the same in both fleets on
purpose: they are what collided.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.local.ports import servers_range
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import wait_until
from tests.orchestrator.reconcile.test_reconcile import destroy, fauxmad, machines, primaries, write_spec
from workers.agent.service import cgroup_base_name
from workers.driver.proc import processes_of

APP = "same"  # both fleets deploy, drain and destroy an app of this name


@pytest.fixture(scope="module")
def fleets() -> Iterator[tuple[DevFleet, DevFleet]]:
    spec = FleetSpec(regions=["mad"], workers_per_region=2)
    with DevFleet(spec) as one, DevFleet(spec) as two:
        yield one, two


def pid_files(fleet: DevFleet) -> dict[str, int]:
    """Machine id -> the pid its worker recorded: what the fleet's stop kills as leftovers (`_kill_machines`)."""
    found = {}
    for path in (fleet.root / "workers").glob("**/machines/*/child.pid"):
        with contextlib.suppress(OSError, ValueError):
            found[path.parent.name] = int(path.read_text().strip())
    return found


def running(fleet: DevFleet) -> dict[str, str]:
    """The fleet's machines of APP: id -> instance id (a restart or a replacement changes it)."""
    return {m.id: m.instance_id for m in machines(fleet, APP)}


def test_two_fleets_deploy_drain_and_destroy_one_app_name_without_seeing_each_other(
    fleets: tuple[DevFleet, DevFleet], tmp_path: Path
) -> None:
    one, two = fleets
    assert one.worker_ids == two.worker_ids  # the same worker ids on one host: what must not collide
    assert {cgroup_base_name(w, one.root / "workers" / w) for w in one.worker_ids}.isdisjoint(
        cgroup_base_name(w, two.root / "workers" / w) for w in two.worker_ids
    )
    home = {"FAUXMAD_HOME": str(tmp_path / "home")}  # one person's home for both fleets' CLIs
    for fleet in (one, two):
        spec = write_spec(tmp_path / f"{fleet.root.name}.toml", APP, regions="mad = 2", spares=0)
        done = fauxmad(fleet, "deploy", "-c", str(spec), env=home)
        assert done.returncode == 0, done.stdout + done.stderr
    first, second = running(one), running(two)
    assert len(first) == len(second) == 2 and not set(first) & set(second)

    # ports: each of the four workers gives its machines ports from a slice of its own, apart from the others'
    # and from the ports the fleets' own servers are picked in (CI: an edge's port, then two workers' machines)
    slices = [part for fleet in (one, two) for part in fleet.machine_ports.values()]
    assert len(slices) == 4 and all(a.high < b.low for a, b in itertools.pairwise(sorted(slices))), slices
    assert all(servers_range().high < part.low or part.high < servers_range().low for part in slices)
    for fleet in (one, two):
        for machine in machines(fleet, APP):
            given = fleet.machine_ports[machine.worker_id]
            assert machine.port is not None and given.low <= machine.port <= given.high, (machine, given)

    # stray-finding: a worker finds a machine's processes by its id (`end_strays`), a fleet's stop by the pid
    # files under its own directory: each finds its own fleet's machines, never one of the other's
    for fleet, own, other in ((one, first, two), (two, second, one)):
        recorded, theirs = pid_files(fleet), set(pid_files(other).values())
        assert set(recorded) == set(own), (recorded, own)
        for machine_id in own:
            pids = set(processes_of(machine_id))
            assert recorded[machine_id] in pids and not pids & theirs, (machine_id, pids, theirs)

    # a drain in one fleet moves its machines off the drained worker; the other's same-named worker keeps its own
    target = primaries(machines(one, APP))[0].worker_id
    try:
        drained = fauxmad(one, "worker", "drain", target, env=home)
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert not [m for m in machines(one, APP) if m.worker_id == target]
        assert running(two) == second  # the same ids, each still on its first instance
        assert all(m.state == "started" for m in machines(two, APP))
    finally:
        assert fauxmad(one, "worker", "uncordon", target).returncode == 0

    # a detached deploy in each writes a log of its own, though app and release number are the same
    for fleet in (one, two):
        v2 = write_spec(tmp_path / f"{fleet.root.name}-v2.toml", APP, regions="mad = 2", spares=0, version="v2")
        detached = fauxmad(fleet, "deploy", "-c", str(v2), "--detach", env=home)
        assert detached.returncode == 0, detached.stderr
    logs = sorted((tmp_path / "home").glob(f"**/deploy-{APP}-v2*.log"))
    assert len(logs) == 2, logs
    for fleet in (one, two):
        wait_until(lambda fleet=fleet: _release_status(fleet, 2) == "complete", f"v2 complete on {fleet.root}", 90)
    # each background process writes its last line after its release's status (CI84 read a log in between)
    for log in logs:
        wait_until(lambda log=log: "v2 deployed" in log.read_text(), f"{log.name} to say v2 deployed", 30)
    assert all(log.read_text().count("v2 deployed") == 1 for log in logs)
    second = running(two)

    # destroying the app in one fleet leaves the other's app running, machine for machine
    destroy(one, APP)
    assert running(two) == second
    assert all(m.state == "started" for m in machines(two, APP))
    destroy(two, APP)


def _release_status(fleet: DevFleet, version: int) -> str:
    listed = fauxmad(fleet, "releases", "-a", APP, "--json")
    if listed.returncode != 0:
        return ""
    return {r["version"]: r["status"] for r in json.loads(listed.stdout)["releases"]}.get(version, "")
