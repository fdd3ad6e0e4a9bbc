"""The test kit's clean-up of a worker's machines (`tests.helpers.kill_machines_of`), with real processes: it must
leave nothing running, or a machine outlives its test and the run (CI55 to CI58: one that ignores SIGTERM ran on for
an hour after `test_executor_leases`, whose last step starts it)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers import RawClient, WorkerProcess, arun, connect_nats, kill_machines_of, wait_until
from workers.driver.proc import processes_of

DEAF = ["sh", "-c", "trap '' TERM; echo armed; while true; do sleep 0.1; done"]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_process_writing_under_the_workers_directory_is_killed_with_its_group(tmp_path: Path) -> None:
    """A shim before its workload took the machine's environment: forked from the launcher, it has the launcher's
    environment (no FAUXMAD_WORKER_ID), its own session, and its machine's log under the worker's data directory.
    The directory finds it, and its group goes with it."""
    data_dir = tmp_path / "w1"
    (data_dir / "machines" / "m1").mkdir(parents=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith("FAUXMAD_")}
    with (data_dir / "machines" / "m1" / "stdout.log").open("wb") as log:
        shim = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], stdout=log, env=env, start_new_session=True)
    wait_until(lambda: bool(subprocess.run(["pgrep", "-P", str(shim.pid)], capture_output=True).stdout), "its child")
    (child,) = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(shim.pid)], capture_output=True).stdout.split()]
    try:
        assert kill_machines_of("w1", data_dir) >= 1
        shim.wait(10)
        wait_until(lambda: not alive(child), "the shim's child killed with its group", timeout=10)
    finally:
        for pid in (shim.pid, child):
            if alive(pid):
                os.kill(pid, 9)


def test_a_workload_of_the_same_worker_id_in_another_fleet_is_left_running(tmp_path: Path) -> None:
    """Worker ids repeat across the fleets of tests running side by side. A workload whose environment names `w1` and
    that runs in its machine's directory under this worker's data directory is killed; one that names `w1` too but
    runs under another fleet's directory is that fleet's, and is left alone (CI66: a clean-up that went by the
    environment alone killed a secure console's job three times over)."""
    ours, theirs = tmp_path / "ours" / "w1", tmp_path / "theirs" / "w1"
    env = {**os.environ, "FAUXMAD_WORKER_ID": "w1", "FAUXMAD_MACHINE_ID": "m1"}
    workloads = []
    for data_dir in (ours, theirs):
        machine_dir = data_dir / "machines" / "m1"
        machine_dir.mkdir(parents=True)
        workloads.append(
            subprocess.Popen(
                ["sleep", "600"], cwd=machine_dir, env=env, stdout=subprocess.DEVNULL, start_new_session=True
            )
        )
    mine, other = workloads
    try:
        assert kill_machines_of("w1", ours) == 1
        mine.wait(10)
        time.sleep(0.2)  # the time is the test: the other fleet's workload is still running after it
        assert other.poll() is None, "another fleet's machine was killed by this worker's clean-up"
    finally:
        for workload in workloads:
            workload.kill()
            workload.wait()


def test_a_machine_started_just_before_the_clean_up_does_not_outlive_it(
    nats_url: str, worker_factory: Callable[..., WorkerProcess], unique: Callable[[str], str]
) -> None:
    """The clean-up right after a start's reply, when the shim may not have forked the workload yet."""
    worker = worker_factory(unique("r"))

    async def launch() -> str:
        nc = await connect_nats(nats_url)
        try:
            raw = RawClient(nc, worker.worker_id)
            config = {"cmd": DEAF}
            machine = await raw.ok("reserve", {"app": "a", "region": worker.region, "config": config, "launch": True})
            return str(machine["id"])
        finally:
            await nc.close()

    machine_id = arun(launch())
    worker.cleanup()
    time.sleep(1.0)  # the time is the test: a workload forked late has taken its environment by then
    left = [pid for pid in processes_of(machine_id) if alive(pid)]
    assert left == [], "a machine outlived its worker's clean-up"
