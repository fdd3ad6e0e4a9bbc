"""What keeps a machine's start short, with real processes and (where the host allows) real cgroups.

Grouped by behaviour: the launcher's spares (forked ahead, holding nothing of the launcher, never
starting a workload without GO, replaced when they die), the start awaited rather than blocking the
event loop (and a cancelled start leaving nothing running), and the pool of cgroups made ahead
(claimed and renamed, refilled, adopted or removed after a crash, released at close).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.workers import test_driver as shared
from tests.workers.test_driver import REPO, Tasks, gone, make_spec, read_pid, run, start
from tests.workers.test_launcher import WAIT_FOR_GO, children_of, finish, parent_of, wait_for_go
from workers.driver import fork_server as launcher
from workers.driver.base import TaskHandle
from workers.driver.cgroup_pool import POOL_PREFIX, POOL_SIZE
from workers.driver.limits import Cgroup1Limits, Cgroup2Limits, Limits, auto_detect
from workers.driver.process import ProcessDriver

# test_driver's fixtures: the run's limits, the task tracker that cleans up, the subreaper
limits, tasks, subreaper = shared.limits, shared.tasks, shared.subreaper


@pytest.fixture
def driver(limits: Limits) -> Iterator[ProcessDriver]:
    made = ProcessDriver(limits)
    yield made
    made.close()


def spares_of(driver: ProcessDriver) -> list[int]:
    """The launcher's children that are waiting for a job: sleeping, childless, and still in the launcher's
    directory (a shim that had a job is in its machine's: one whose machine just ended is also sleeping and
    childless for a moment before it exits)."""
    assert driver.launcher_pid is not None
    home = cwd_of(driver.launcher_pid)
    return [
        pid
        for pid, state in children_of(driver.launcher_pid)
        if state == "S" and not children_of(pid) and cwd_of(pid) == home
    ]


def cwd_of(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:  # gone meanwhile
        return None


def open_fds(pid: int) -> dict[int, str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    return {int(fd): os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)}


# ---------------------------------------------------------------------------------------------------
# spares


def test_a_start_hands_its_job_to_a_spare_forked_ahead(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    start(driver, tasks, make_spec(tmp_path / "first", ["true"]))  # spawns the launcher
    wait_until(lambda: len(spares_of(driver)) == launcher.SPARES, "the launcher's spares", interval=0.01)
    waiting = spares_of(driver)
    assert os.sched_getscheduler(driver.launcher_pid or 0) == os.SCHED_BATCH  # never preempts the worker
    for spare in waiting:
        assert os.getsid(spare) == spare  # its own session already
        assert os.sched_getscheduler(spare) == os.SCHED_OTHER  # what its machine will inherit
        fds = open_fds(spare)
        assert fds[0] == fds[1] == os.devnull
        assert len(fds) == 4, fds  # stdin, stdout, stderr and its channel: nothing of the launcher's
    handle = start(driver, tasks, make_spec(tmp_path / "second", WAIT_FOR_GO))
    assert handle.pid in waiting
    wait_until(
        lambda: read_pid(Path(handle.workdir) / "child.pid") is not None,
        "the pid in the workload's child.pid",
        interval=0.01,
    )
    assert os.getsid(handle.pid) == handle.pid and parent_of(handle.pid) == driver.launcher_pid
    assert Path(os.readlink(f"/proc/{handle.pid}/cwd")) == Path(handle.workdir)
    wait_until(lambda: len(spares_of(driver)) == launcher.SPARES, "the launcher's spares", interval=0.01)  # replaced
    assert finish(driver, handle).exit_code == 7


def test_a_burst_beyond_the_spares_still_starts_every_machine(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    async def burst() -> list[TaskHandle]:
        specs = [make_spec(tmp_path / str(i), ["sh", "-c", f"exit {i}"]) for i in range(launcher.SPARES * 3)]
        return await asyncio.gather(*(driver.start(spec) for spec in specs))

    handles = [tasks.add(handle) for handle in run(burst())]
    assert len({handle.pid for handle in handles}) == len(handles)

    async def ends() -> list[int | None]:
        statuses = await asyncio.gather(*(driver.wait(handle) for handle in handles))
        return [status.exit_code for status in statuses]

    assert run(asyncio.wait_for(ends(), 20)) == list(range(len(handles)))


def test_a_spare_killed_while_waiting_is_replaced_and_reaped(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    start(driver, tasks, make_spec(tmp_path / "first", ["true"]))
    wait_until(lambda: len(spares_of(driver)) == launcher.SPARES, "the launcher's spares", interval=0.01)
    victim = spares_of(driver)[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: victim not in dict(children_of(driver.launcher_pid or 0)), "the victim reaped", interval=0.01
    )  # reaped, not a zombie
    handles = [start(driver, tasks, make_spec(tmp_path / str(i), ["sh", "-c", "exit 3"])) for i in range(3)]
    assert victim not in {handle.pid for handle in handles}
    assert [finish(driver, handle).exit_code for handle in handles] == [3, 3, 3]
    wait_until(lambda: len(spares_of(driver)) == launcher.SPARES, "the launcher's spares", interval=0.01)


def test_a_request_too_big_for_one_message_starts_directly_and_keeps_the_launcher(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    start(driver, tasks, make_spec(tmp_path / "first", ["true"]))
    launcher_pid = driver.launcher_pid
    # under MAX_REQUEST, over a socket buffer (~208 KiB); each variable under exec's 128 KiB limit
    huge = {**shared.ENV, "BIG1": "x" * (110 << 10), "BIG2": "y" * (110 << 10)}
    handle = start(driver, tasks, make_spec(tmp_path / "big", wait_for_go('"${#BIG2}"'), env=huge))
    assert parent_of(handle.pid) == os.getpid()  # spawned the direct way (it runs until `finish`)
    assert driver.launcher_pid == launcher_pid  # not taken for a failed launcher
    assert finish(driver, handle).exit_code == (110 << 10) % 256


ABANDON_A_SPARE = """
import os, sys
from workers.driver import fork_server as launcher
workdir = sys.argv[1]
spares = {}
assert launcher._add_spare(spares)
request = launcher.make_request(
    workdir=workdir, cwd=workdir, cmd=["sh", "-c", "touch ran"], env={}, cgroups=[], rlimit_as=None
)
fds = launcher._open_job_files(request)
pid, ticks, go_fd = launcher._hand_to_spare(spares, launcher.encode_request(request), fds)
print(pid, flush=True)
os._exit(0)  # the launcher dies after handing the job over and before saying GO
"""


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.usefixtures("subreaper")
def test_a_spare_whose_launcher_dies_before_go_starts_nothing(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-I", "-S", "-c"),
            f"import sys; sys.path.insert(0, {str(REPO)!r})\n{ABANDON_A_SPARE}",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=20,
    )
    spare = int(out.stdout)
    _, status = os.waitpid(spare, 0)  # orphaned to us, a subreaper
    assert os.waitstatus_to_exitcode(status) == launcher.ABANDONED
    assert not (tmp_path / "ran").exists() and not (tmp_path / "child.pid").exists()


@pytest.mark.usefixtures("subreaper")
def test_a_killed_launcher_takes_its_spares_and_no_machine(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    running = start(driver, tasks, make_spec(tmp_path / "running", WAIT_FOR_GO))
    wait_until(lambda: len(spares_of(driver)) == launcher.SPARES, "the launcher's spares", interval=0.01)
    waiting, launcher_pid = spares_of(driver), driver.launcher_pid
    assert launcher_pid is not None
    os.kill(launcher_pid, signal.SIGKILL)
    wait_until(lambda: gone(launcher_pid), "the launcher gone", interval=0.01)
    for spare in waiting:  # end of file on their channels; orphaned to us
        _, status = os.waitpid(spare, 0)
        assert os.waitstatus_to_exitcode(status) == launcher.ABANDONED
    assert driver.recover(running)
    assert finish(driver, running).exit_code == 7


# ---------------------------------------------------------------------------------------------------
# the start is awaited, and a cancelled one leaves nothing behind


def test_the_event_loop_runs_while_the_launcher_answers(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    """The first start waits for the launcher's own start-up (tens of ms): other tasks run meanwhile."""

    async def go() -> tuple[TaskHandle, int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        ticking = asyncio.ensure_future(ticker())
        handle = await driver.start(make_spec(tmp_path, wait_for_go("0")))  # alive until `finish`: see below
        stop.set()
        await ticking
        return handle, ticks

    handle, ticks = run(go())
    tasks.add(handle)
    assert driver.launcher_pid is not None and parent_of(handle.pid) == driver.launcher_pid
    assert ticks > 10
    assert finish(driver, handle).exit_code == 0


def test_a_start_cancelled_before_the_reply_starts_nothing(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    async def go() -> None:
        starting = asyncio.ensure_future(driver.start(make_spec(tmp_path, ["sh", "-c", "touch ran; sleep 30"])))
        await asyncio.sleep(0)  # the request is out; the launcher is still starting up
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    run(go())
    # not a wait: nothing may happen in this window (a workload started anyway would have touched `ran` by now)
    time.sleep(0.3)
    assert not (tmp_path / "machine" / "ran").exists() and not (tmp_path / "machine" / "child.pid").exists()
    assert driver.launcher_pid is None  # discarded: the next start spawns a new one
    handle = start(driver, tasks, make_spec(tmp_path / "next", ["sh", "-c", "exit 2"]))
    assert run(asyncio.wait_for(driver.wait(handle), 10)).exit_code == 2


def test_a_start_cancelled_after_the_reply_ends_the_machine_it_started(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    start(driver, tasks, make_spec(tmp_path / "warm", ["true"]))
    wait_until(lambda: len(spares_of(driver)) == launcher.SPARES, "the launcher's spares", interval=0.01)
    spec = make_spec(tmp_path / "cancelled", ["sleep", "30"])
    workdir = Path(spec.workdir)

    launcher_pid = driver.launcher_pid
    assert launcher_pid is not None

    async def go() -> None:
        os.kill(launcher_pid, signal.SIGSTOP)  # so that the reply cannot come before the start awaits it
        starting = asyncio.ensure_future(driver.start(spec))
        await asyncio.sleep(0)  # the request is out
        os.kill(launcher_pid, signal.SIGCONT)
        time.sleep(0.5)  # the loop is stuck: the launcher replies, says GO, the workload starts
        assert read_pid(workdir / "child.pid") is not None
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        while driver._orphans:  # the machine being ended
            await asyncio.sleep(0.01)

    run(go())
    workload = read_pid(workdir / "child.pid")
    assert workload is not None and gone(workload)
    assert (workdir / "exit.json").exists()  # recorded like any end
    assert spec.machine_id not in {Path(name).name for name in _cgroup_names(driver)}  # cleaned up


def _cgroup_names(driver: ProcessDriver) -> list[str]:
    limits = driver.limits
    bases = [getattr(limits, name, None) for name in ("base", "memory_base", "cpu_base")]
    return [str(entry) for base in bases if isinstance(base, Path) and base.is_dir() for entry in base.iterdir()]


# ---------------------------------------------------------------------------------------------------
# cgroups made ahead


@pytest.fixture
def cgroups(limits: Limits) -> Cgroup1Limits | Cgroup2Limits:
    if not isinstance(limits, Cgroup1Limits | Cgroup2Limits):
        pytest.skip(f"no usable cgroups on this host (auto_detect chose {limits.describe()})")
    return limits


def pooled_dirs(limits: Cgroup1Limits | Cgroup2Limits) -> list[Path]:
    bases = [limits.base] if isinstance(limits, Cgroup2Limits) else [limits.memory_base, limits.cpu_base]
    return [entry for base in bases if base is not None and base.is_dir() for entry in base.iterdir()
            if entry.name.startswith(POOL_PREFIX)]  # fmt: skip


def test_a_start_claims_a_pooled_cgroup_and_the_pool_refills(
    cgroups: Cgroup1Limits | Cgroup2Limits, driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    start(driver, tasks, make_spec(tmp_path / "first", ["true"], memory_mb=64))
    wait_until(lambda: len(cgroups.pool) == POOL_SIZE, "the cgroup pool full", interval=0.01)
    pooled = {path.stat().st_ino for path in pooled_dirs(cgroups)}
    handle = start(driver, tasks, make_spec(tmp_path / "second", ["sleep", "30"], memory_mb=64, cpus=2))
    machine_id = Path(handle.cgroups[0]).name
    assert all(Path(cgroup).name == machine_id for cgroup in handle.cgroups)  # renamed after the machine
    assert all(Path(cgroup).stat().st_ino in pooled for cgroup in handle.cgroups)  # not created now
    wait_until(lambda: len(cgroups.pool) == POOL_SIZE, "the cgroup pool full", interval=0.01)
    wait_until(
        lambda: read_pid(Path(handle.workdir) / "child.pid") is not None,
        "the pid in the workload's child.pid",
        interval=0.01,
    )
    workload = str(read_pid(Path(handle.workdir) / "child.pid"))
    for cgroup in handle.cgroups:  # joined (just before its exec)
        wait_until(
            lambda: workload in (Path(cgroup) / "cgroup.procs").read_text().split(),  # noqa: B023
            "the workload in its cgroup",
            interval=0.01,
        )
    if isinstance(cgroups, Cgroup1Limits):
        memory, cpu = map(Path, handle.cgroups)
        assert (memory / "memory.limit_in_bytes").read_text().strip() == str(64 << 20)
        assert (cpu / "cpu.shares").read_text().strip() == "2048"  # preset for cpus=1: written at claim


def test_close_releases_the_pool_and_a_later_start_fills_it_again(
    cgroups: Cgroup1Limits | Cgroup2Limits, tasks: Tasks, tmp_path: Path
) -> None:
    driver = ProcessDriver(cgroups)
    start(driver, tasks, make_spec(tmp_path / "a", ["true"]))
    wait_until(lambda: len(cgroups.pool) == POOL_SIZE, "the cgroup pool full", interval=0.01)
    driver.close()
    assert pooled_dirs(cgroups) == [] and len(cgroups.pool) == 0
    again = ProcessDriver(cgroups)
    try:
        start(again, tasks, make_spec(tmp_path / "b", ["true"]))
        wait_until(lambda: len(cgroups.pool) == POOL_SIZE, "the cgroup pool full", interval=0.01)
    finally:
        again.close()
    assert pooled_dirs(cgroups) == []


def test_pooled_cgroups_left_by_a_crash_are_adopted_up_to_the_size_and_the_rest_removed(
    cgroups: Cgroup1Limits | Cgroup2Limits, tasks: Tasks, tmp_path: Path
) -> None:
    base_name = f"{shared.BASE}-crash"
    crashed = auto_detect(base_name)
    assert isinstance(crashed, Cgroup1Limits | Cgroup2Limits)
    crashed.setup()  # the bases, as a worker that ran machines has them
    bases = [Path(directory).parent for directory in crashed.machine_dirs("x")]
    left = [f"{POOL_PREFIX}left{i}" for i in range(POOL_SIZE + 2)]
    for name in left:
        for base in bases:
            (base / name).mkdir()
    (bases[0] / f"{POOL_PREFIX}half").mkdir()  # a crash between the two mkdirs (v1)

    successor = auto_detect(base_name)
    assert isinstance(successor, Cgroup1Limits | Cgroup2Limits)
    try:
        claimed = successor.prepare("m-1", 64, 1)
        wait_until(lambda: len(successor.pool) == POOL_SIZE, "the successor's cgroup pool full", interval=0.01)

        # bounded: adopted up to the size (the first claim found the pool empty), the rest removed; the pool
        # is full before the rest is removed (CI: a look in between saw the four and one not removed yet)
        def left_at_most_the_size() -> set[str]:
            names = {path.name for path in pooled_dirs(successor)}
            return names if len(names) <= POOL_SIZE else set()

        names = wait_until(left_at_most_the_size, "the leftovers beyond the pool's size removed")
        assert len(names) == POOL_SIZE and names < set(left)
        assert all(Path(cgroup).name == "m-1" for cgroup in claimed)
        successor.cleanup(claimed)
    finally:
        successor.close()
    assert pooled_dirs(successor) == []
    assert all(not base.exists() for base in bases)


def test_a_machine_whose_cgroup_exists_reuses_it(
    cgroups: Cgroup1Limits | Cgroup2Limits, driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    """A restart of the same machine: its cgroups are still there; the pool is not touched."""
    first = start(driver, tasks, make_spec(tmp_path / "a", ["true"], machine_id="m-again"))
    run(asyncio.wait_for(driver.wait(first), 10))
    wait_until(lambda: len(cgroups.pool) == POOL_SIZE, "the cgroup pool full", interval=0.01)
    second = start(driver, tasks, make_spec(tmp_path / "b", ["true"], machine_id="m-again", memory_mb=96))
    assert second.cgroups == first.cgroups
    assert len(cgroups.pool) == POOL_SIZE
    run(asyncio.wait_for(driver.wait(second), 10))
