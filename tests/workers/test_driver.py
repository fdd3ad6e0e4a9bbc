"""The process driver, shim and limits, with real processes and (where the host allows) real cgroups.

Grouped by behaviour: what a task sees, how it ends, how it is stopped, surviving the worker,
resource limits. Every test registers its handles with `tasks`, whose teardown kills whatever is
left (workload process group, shim) and removes the cgroups.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from tests.helpers import wait_until
from workers.driver.base import ExitStatus, TaskHandle, TaskSpec
from workers.driver.fork_server import prepare_workdir
from workers.driver.limits import Cgroup2Limits, Limits, RlimitLimits, auto_detect, slow_migration_hint
from workers.driver.proc import group_stopped
from workers.driver.process import ProcessDriver
from workers.driver.shim import temporary

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}
PR_SET_CHILD_SUBREAPER = 36
BASE = f"test-driver-{os.getpid()}"  # this test run's cgroup subtree, shared with the starters


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def limits() -> Iterator[Limits]:
    detected = auto_detect(BASE)
    yield detected
    detected.close()


class Tasks:
    """Handles to clean up after a test, however it ended."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.handles: list[TaskHandle] = []

    def add(self, handle: TaskHandle) -> TaskHandle:
        self.handles.append(handle)
        return handle

    def kill_all(self) -> None:
        for handle in self.handles:
            workload = read_pid(Path(handle.workdir) / "child.pid")
            with contextlib.suppress(ProcessLookupError):
                if workload is not None and os.getsid(workload) == handle.pid:  # not a reused pid
                    os.killpg(workload, signal.SIGKILL)
            if ProcessDriver(self.limits).recover(handle):
                with contextlib.suppress(ProcessLookupError):  # it may end by itself between the look and the kill
                    os.kill(handle.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(handle.pid, 0)  # only for our own (or adopted) children
            self.limits.cleanup(handle.cgroups)
            for cgroup in handle.cgroups:
                assert not Path(cgroup).exists(), f"cgroup left behind: {cgroup}"


@pytest.fixture
def tasks(limits: Limits) -> Iterator[Tasks]:
    tracker = Tasks(limits)
    yield tracker
    tracker.kill_all()


@pytest.fixture
def driver(limits: Limits) -> Iterator[ProcessDriver]:
    made = ProcessDriver(limits)
    yield made
    made.close()


@pytest.fixture
def subreaper() -> Iterator[None]:
    """Orphaned shims (their starter killed) become our children instead of pid 1's, so the test can
    reap them: pid 1 in this container does not reap zombies."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def make_spec(tmp_path: Path, cmd: list[str], **overrides: Any) -> TaskSpec:
    fields: dict[str, Any] = {
        "machine_id": f"m-{os.urandom(4).hex()}",
        "cmd": cmd,
        "env": dict(ENV),
        "workdir": str(tmp_path / "machine"),
        "memory_mb": 256,
        "cpus": 1,
    }
    fields.update(overrides)
    return TaskSpec(**fields)


def start(driver: ProcessDriver, tasks: Tasks, spec: TaskSpec) -> TaskHandle:
    return tasks.add(run(driver.start(spec)))


def start_and_wait(driver: ProcessDriver, tasks: Tasks, spec: TaskSpec) -> tuple[TaskHandle, ExitStatus]:
    async def go() -> tuple[TaskHandle, ExitStatus]:
        handle = tasks.add(await driver.start(spec))
        return handle, await asyncio.wait_for(driver.wait(handle), 20)

    return run(go())


# ---------------------------------------------------------------------------------------------------
# what the workload sees


def test_exit_code_is_recorded(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle, status = start_and_wait(driver, tasks, make_spec(tmp_path, ["sh", "-c", "exit 3"]))
    assert status.exit_code == 3
    assert status.signal is None
    assert not status.oom_killed and not status.lost and not status.success
    assert status.finished_at >= handle.started_at


def test_env_and_cwd_reach_the_workload(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, ["sh", "-c", 'echo "greeting=$GREETING"; pwd'])
    spec = msgspec.structs.replace(spec, env={**ENV, "GREETING": "hello world"})
    handle, status = start_and_wait(driver, tasks, spec)
    assert status.success
    lines = handle.stdout_path.read_text().splitlines()
    assert lines == ["greeting=hello world", str(tmp_path / "machine")]


def test_stdout_and_stderr_are_captured_and_appended(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, ["sh", "-c", "echo out; echo err >&2"])
    start_and_wait(driver, tasks, spec)
    handle, _ = start_and_wait(driver, tasks, spec)  # a restart appends to the same logs
    assert handle.stdout_path.read_text() == "out\nout\n"
    assert handle.stderr_path.read_text() == "err\nerr\n"


def test_workload_starts_with_default_signals(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    """The shim blocks TERM/INT/HUP/QUIT and Python ignores PIPE/XFSZ: none of it may leak into exec."""
    handle, _ = start_and_wait(driver, tasks, make_spec(tmp_path, ["cat", "/proc/self/status"]))
    fields = dict(line.split(":\t", 1) for line in handle.stdout_path.read_text().splitlines())
    assert int(fields["SigBlk"], 16) == 0
    # only signals a process can reset: glibc's reserved real-time signals (32, 33) may arrive ignored
    # from whoever started the test run (`just` does that), and no program can change them
    resettable = sum(1 << (int(sig) - 1) for sig in signal.valid_signals() if int(sig) not in (9, 19))
    assert int(fields["SigIgn"], 16) & resettable == 0


def test_workload_has_its_own_process_group_in_the_shims_session(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "30"]))
    wait_until(lambda: (Path(handle.workdir) / "child.pid").exists(), "the workload's child.pid", interval=0.01)
    workload = read_pid(Path(handle.workdir) / "child.pid")
    assert workload is not None
    assert os.getpgid(workload) == workload
    assert os.getsid(workload) == handle.pid == os.getsid(handle.pid)
    run(driver.destroy(handle, force=True))


def test_exec_failure_exits_127_with_a_message(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle, status = start_and_wait(driver, tasks, make_spec(tmp_path, ["/nonexistent/program"]))
    assert status.exit_code == 127
    assert "/nonexistent/program" in handle.stderr_path.read_text()


def test_concurrent_waits_all_resolve(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    async def go() -> list[ExitStatus]:
        handle = tasks.add(await driver.start(make_spec(tmp_path, ["sh", "-c", "sleep 0.2; exit 4"])))
        return await asyncio.wait_for(asyncio.gather(*(driver.wait(handle) for _ in range(5))), 20)

    statuses = run(go())
    assert {s.exit_code for s in statuses} == {4}
    assert len({s.finished_at for s in statuses}) == 1


def test_driver_works_under_uvloop(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def go() -> tuple[ExitStatus, ExitStatus]:
        quick = tasks.add(await driver.start(make_spec(tmp_path / "a", ["sh", "-c", "exit 9"])))
        slow = tasks.add(await driver.start(make_spec(tmp_path / "b", ["sleep", "30"])))
        return await asyncio.wait_for(driver.wait(quick), 10), await driver.stop(slow, 5, signal.SIGTERM)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        quick, slow = runner.run(go())
    assert quick.exit_code == 9 and slow.signal == signal.SIGTERM


def test_inspect_running_and_ended(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sh", "-c", "touch ready; exec sleep 30"]))
    wait_until(lambda: (Path(handle.workdir) / "ready").exists(), "the workload's ready file", interval=0.01)
    state = driver.inspect(handle)
    assert state.running and state.exit is None
    assert state.child_pid == read_pid(Path(handle.workdir) / "child.pid")
    assert state.rss_bytes is not None and state.rss_bytes > 0
    run(driver.stop(handle, 5, signal.SIGTERM))
    ended = driver.inspect(handle)
    assert not ended.running
    assert ended.exit is not None and ended.exit.signal == signal.SIGTERM


# The leader vforks a child that the group's stop catches before its exec (as dash runs every command):
# the leader then waits in vfork(), in state D, while the group is stopped.
VFORK_CAUGHT = r"""
#include <signal.h>
#include <unistd.h>
int main(void) {
    if (vfork() == 0) { kill(getpid(), SIGSTOP); _exit(0); }
    for (;;) pause();
}
"""


@pytest.mark.fleet  # starts processes of its own
def test_a_group_stopped_while_its_leader_waits_in_vfork_is_stopped(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    """A worker restarted under a suspended machine asks whether it is still stopped; a leader waiting in
    vfork() for a stopped child is `D`, not `T`, and the machine was taken for resumed (seen in CI with dash)."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) to build the vfork workload")
    source, binary = tmp_path / "vfork.c", tmp_path / "vfork"
    source.write_text(VFORK_CAUGHT)
    subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], check=True)
    handle = start(driver, tasks, make_spec(tmp_path, [str(binary)]))
    wait_until(
        lambda: read_pid(Path(handle.workdir) / "child.pid") is not None,
        "the pid in the workload's child.pid",
        interval=0.01,
    )
    leader = read_pid(Path(handle.workdir) / "child.pid")
    assert leader is not None
    # the leader is D from its vfork() on, a moment before the child stops itself: wait for both
    wait_until(
        lambda: proc_state(leader) == "D" and any(proc_state(pid) == "T" for pid in children_of(leader)),
        "the leader waiting in vfork (D) with a stopped child (T)",
        interval=0.01,
    )
    assert driver.inspect(handle).stopped
    assert group_stopped(["D", "T"]) and group_stopped(["T", "Z"])
    assert not group_stopped(["D", "T", "S"]) and not group_stopped(["D"]) and not group_stopped(["S", "R"])


# ---------------------------------------------------------------------------------------------------
# stop, signal, destroy


def test_stop_with_sigterm_ends_a_sleeping_process(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "30"]))
    # Right after start: the shim may not have forked yet; the signal must not be lost. SIGTERM as the cause
    # of the end says it was not lost (the sleep would end by itself, the 10 s timeout by SIGKILL)
    status = run(driver.stop(handle, 10, signal.SIGTERM))
    assert status.signal == signal.SIGTERM and status.exit_code is None
    assert not driver.recover(handle)


def test_stop_escalates_to_sigkill(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sh", "-c", 'trap "" TERM; touch ready; sleep 30']))
    wait_until(lambda: (Path(handle.workdir) / "ready").exists(), "the workload's ready file", interval=0.01)
    began = time.monotonic()
    status = run(driver.stop(handle, 0.5, signal.SIGTERM))
    assert status.signal == signal.SIGKILL  # escalated: the sleep would end by itself, after 30 s
    assert time.monotonic() - began >= 0.5  # after the TERM's whole timeout: a lower bound, which load cannot break


def test_stop_after_the_end_returns_the_status(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle, first = start_and_wait(driver, tasks, make_spec(tmp_path, ["sh", "-c", "exit 2"]))
    assert run(driver.stop(handle, 1, signal.SIGTERM)) == first
    run(driver.signal(handle, signal.SIGTERM))  # nothing to signal: no error, no stray kill


def test_signal_reaches_the_workload(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    script = 'trap "echo got usr1; exit 0" USR1; touch ready; while :; do sleep 0.05; done'
    handle = start(driver, tasks, make_spec(tmp_path, ["sh", "-c", script]))
    wait_until(lambda: (Path(handle.workdir) / "ready").exists(), "the workload's ready file", interval=0.01)

    async def go() -> ExitStatus:
        await driver.signal(handle, signal.SIGUSR1)
        return await asyncio.wait_for(driver.wait(handle), 10)

    assert run(go()).exit_code == 0
    assert "got usr1" in handle.stdout_path.read_text()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc (the fields after the command's closing parenthesis)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
    return found


def proc_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_workload_once_signalled_is_held_until_it_ends(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    """A suspend's SIGSTOP finds the workload from child.pid; the resume's SIGCONT reuses what it found (a
    pidfd, not the files), and once the workload has ended nothing is signalled any more."""
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "30"]))
    pid_file = Path(handle.workdir) / "child.pid"
    wait_until(lambda: read_pid(pid_file) is not None, "the pid in the pid file", interval=0.01)
    workload = read_pid(pid_file)
    assert workload is not None

    async def go() -> ExitStatus:
        await driver.signal(handle, signal.SIGSTOP)
        wait_until(lambda: proc_state(workload) == "T", "the workload stopped (T)", interval=0.01)
        pid_file.rename(pid_file.with_name("child.pid.away"))  # the next signal cannot read it
        await driver.signal(handle, signal.SIGCONT)
        wait_until(lambda: proc_state(workload) == "S", "the workload running again (S)", interval=0.01)
        pid_file.with_name("child.pid.away").rename(pid_file)
        os.killpg(workload, signal.SIGKILL)
        ended = await asyncio.wait_for(driver.wait(handle), 10)
        await driver.signal(handle, signal.SIGTERM)  # ended: no error, no signal to a pid that may be reused
        return ended

    assert run(go()).signal == signal.SIGKILL
    assert driver._workloads == {}, "the pidfd of an ended workload is closed"


def test_destroy_stops_removes_cgroups_and_keeps_logs(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sh", "-c", "echo hello; exec sleep 30"]))
    wait_until(lambda: handle.stdout_path.read_text() == "hello\n", "hello on the stdout", interval=0.01)
    run(driver.destroy(handle, force=False))
    assert not driver.recover(handle)
    assert all(not Path(cgroup).exists() for cgroup in handle.cgroups)
    assert handle.stdout_path.read_text() == "hello\n"
    assert handle.status_path.exists()


def test_a_start_waits_for_the_run_before_it_in_the_same_directory(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    """The run before is still ending when the next one starts in the machine's directory: its shim's
    `exit.json` must not land in the new run's, where it made the new run look ended (no signal reached it:
    a stop never ended it) or was lost to the new run's clearing (its temporary file removed before the rename).
    Fails without the driver's wait for the previous run (the stop below waits forever)."""
    first = make_spec(tmp_path, ["sh", "-c", "sleep 0.5; exit 3"])
    second = msgspec.structs.replace(first, cmd=["sleep", "30"])

    async def go() -> tuple[float, TaskHandle, ExitStatus]:
        asked = time.time()  # the first run's `sleep 0.5` begins after this (its handle's stamp comes after its spawn)
        before = tasks.add(await driver.start(first))
        after = tasks.add(await driver.start(second))  # no wait for `before` in between
        while not gone(before.pid):  # the run before has ended, however the start above went
            await asyncio.sleep(0.01)
        status = await asyncio.wait_for(driver.stop(after, 5.0, signal.SIGTERM), 20)
        return asked, after, status

    asked, after, status = run(go())
    assert after.started_at >= asked + 0.5, "the second run started before the first had ended"
    assert status.signal == signal.SIGTERM


@pytest.mark.fleet  # starts processes of its own
def test_a_runs_start_keeps_the_temporary_files_of_writers_still_running(tmp_path: Path) -> None:
    """A shim (or the launcher) writes `exit.json` through a temporary file of its own, which the next run's
    clearing of the directory leaves alone while its writer lives (it is about to rename it); a dead writer's
    is removed. Fails with one shared temporary name (`exit.json.tmp`), which the clearing removed."""
    workdir = tmp_path / "machine"
    workdir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = Path(temporary(str(workdir / "exit.json")))
    stale = workdir / f"exit.json.tmp.{dead.pid}"
    for path in (live, stale, workdir / "exit.json", workdir / "child.pid"):
        path.write_text("{}")
    prepare_workdir(str(workdir))
    assert sorted(path.name for path in workdir.iterdir()) == [live.name]


def test_shim_killed_under_a_running_workload_is_lost(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "30"]))
    wait_until(lambda: (Path(handle.workdir) / "child.pid").exists(), "the workload's child.pid", interval=0.01)
    workload = read_pid(Path(handle.workdir) / "child.pid")
    assert workload is not None
    os.kill(handle.pid, signal.SIGKILL)
    status = run(asyncio.wait_for(driver.wait(handle), 10))
    assert status.lost and not status.success
    wait_until(lambda: gone(workload), "the workload gone", interval=0.01)  # reported as ended, so it must have ended


# ---------------------------------------------------------------------------------------------------
# surviving the worker

STARTER = """
import asyncio, sys, msgspec
from workers.driver.base import TaskSpec
from workers.driver.limits import auto_detect
from workers.driver.process import ProcessDriver

spec = msgspec.json.decode(sys.argv[1], type=TaskSpec)
driver = ProcessDriver(auto_detect(sys.argv[2]))
handle = asyncio.run(driver.start(spec))
sys.stdout.buffer.write(msgspec.json.encode(handle) + b"\\n")
sys.stdout.write(f"{driver.launcher_pid}\\n")
sys.stdout.flush()
sys.stdin.read()  # until killed
"""


# starter pid -> the pid of its launcher (the shims' parent), which must die with the starter
LAUNCHERS: dict[int, int] = {}


def start_elsewhere(spec: TaskSpec) -> tuple[subprocess.Popen[bytes], TaskHandle]:
    """Start the task from another process (a worker that will die), return it and the handle."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, msgspec.json.encode(spec).decode(), BASE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert starter.stdout is not None
    line = starter.stdout.readline()
    assert line, "the starter died before starting the task"
    launcher = starter.stdout.readline().strip()
    if launcher != b"None":
        LAUNCHERS[starter.pid] = int(launcher)
    return starter, msgspec.json.decode(line, type=TaskHandle)


def kill_starter(starter: subprocess.Popen[bytes]) -> None:
    """kill -9 the starter: its launcher must end too (end of file on its socket), its tasks must not."""
    starter.kill()
    starter.wait()
    for stream in (starter.stdin, starter.stdout):
        if stream is not None:
            stream.close()
    launcher = LAUNCHERS.pop(starter.pid, None)
    if launcher is not None:
        wait_until(lambda: gone(launcher), "the launcher gone", interval=0.01)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(launcher, 0)  # orphaned to us when we are a subreaper


@pytest.mark.usefixtures("subreaper")
def test_task_survives_the_death_of_its_starter(limits: Limits, tasks: Tasks, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 7"])
    starter, handle = start_elsewhere(spec)
    tasks.add(handle)
    kill_starter(starter)

    driver = ProcessDriver(limits)  # the restarted worker
    assert driver.recover(handle)
    assert driver.inspect(handle).running

    async def go() -> ExitStatus:
        waiting = asyncio.ensure_future(driver.wait(handle))
        await asyncio.sleep(0.1)  # not a wait: the time is the test (the wait must not end while the task runs)
        assert not waiting.done()
        (Path(handle.workdir) / "go").touch()
        return await asyncio.wait_for(waiting, 10)

    status = run(go())
    assert status.exit_code == 7 and not status.lost
    assert not driver.recover(handle)


@pytest.mark.usefixtures("subreaper")
def test_exit_while_nobody_watched_is_read_from_exit_json(limits: Limits, tasks: Tasks, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 5"])
    starter, handle = start_elsewhere(spec)
    tasks.add(handle)
    kill_starter(starter)
    (Path(handle.workdir) / "go").touch()
    wait_until(
        lambda: handle.status_path.exists() and gone(handle.pid), "the status file, and the shim gone", interval=0.01
    )

    driver = ProcessDriver(limits)
    assert not driver.recover(handle)
    state = driver.inspect(handle)
    assert not state.running and state.exit is not None and state.exit.exit_code == 5
    status = run(asyncio.wait_for(driver.wait(handle), 10))
    assert status.exit_code == 5 and not status.lost


@pytest.mark.usefixtures("subreaper")
def test_wait_on_a_task_that_is_not_our_child(limits: Limits, tasks: Tasks, tmp_path: Path) -> None:
    spec = make_spec(tmp_path, ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 6"])
    starter, handle = start_elsewhere(spec)  # the starter stays alive: the shim is its child
    tasks.add(handle)
    try:
        driver = ProcessDriver(limits)
        assert driver.recover(handle)

        async def go() -> ExitStatus:
            waiting = asyncio.ensure_future(driver.wait(handle))
            (Path(handle.workdir) / "go").touch()
            return await asyncio.wait_for(waiting, 10)

        assert run(go()).exit_code == 6
    finally:
        kill_starter(starter)


def test_recover_is_false_for_a_dead_pid_or_other_start_ticks(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "30"]))
    assert driver.recover(handle)
    assert not driver.recover(msgspec.structs.replace(handle, start_ticks=handle.start_ticks + 1))

    # A handle whose pid now belongs to another process: wait() must not watch that process.
    other = tmp_path / "other"
    other.mkdir()
    stranger = msgspec.structs.replace(handle, start_ticks=handle.start_ticks + 1, workdir=str(other))
    assert run(asyncio.wait_for(driver.wait(stranger), 5)).lost
    assert driver.recover(handle)  # the real task was left alone

    status = run(driver.stop(handle, 5, signal.SIGTERM))
    assert not driver.recover(handle)  # dead (and reaped)
    assert run(driver.wait(handle)) == status  # and its status is still known


# ---------------------------------------------------------------------------------------------------
# limits


def test_memory_over_the_limit_is_oom_killed(
    limits: Limits, driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    if limits.mode == "rlimit":
        pytest.skip(f"no usable cgroups on this host (auto_detect chose {limits.describe()})")
    program = "b = bytearray(200 * 1024 * 1024); import time; time.sleep(1)"
    spec = make_spec(tmp_path, [sys.executable, "-I", "-S", "-c", program], memory_mb=32)
    _, status = start_and_wait(driver, tasks, spec)
    assert status.oom_killed
    assert status.signal == signal.SIGKILL
    assert not status.success


def test_a_normal_sigkill_is_not_an_oom(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "30"]))
    wait_until(lambda: (Path(handle.workdir) / "child.pid").exists(), "the workload's child.pid", interval=0.01)

    async def go() -> ExitStatus:
        await driver.signal(handle, signal.SIGKILL)
        return await asyncio.wait_for(driver.wait(handle), 10)

    status = run(go())
    assert status.signal == signal.SIGKILL and not status.oom_killed


def test_cpus_set_the_cpu_weight_and_the_workload_joins_its_cgroups(
    limits: Limits, driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    if limits.mode == "rlimit":
        pytest.skip(f"no usable cgroups on this host (auto_detect chose {limits.describe()})")
    spec = make_spec(tmp_path, ["cat", "/proc/self/cgroup"], cpus=2, memory_mb=48)
    handle, status = start_and_wait(driver, tasks, spec)
    assert status.success
    memberships = handle.stdout_path.read_text()
    for cgroup in handle.cgroups:
        assert cgroup.endswith(f"/{spec.machine_id}")
        assert f"/fauxmad/{Path(cgroup).parent.name}/{spec.machine_id}" in memberships
    files = {name: Path(cgroup) / name for cgroup in handle.cgroups for name in os.listdir(cgroup)}
    if limits.mode == "cgroup1":
        assert files["cpu.shares"].read_text().strip() == "2048"
        assert files["memory.limit_in_bytes"].read_text().strip() == str(48 * 1024 * 1024)
        if "memory.memsw.limit_in_bytes" in files:
            assert files["memory.memsw.limit_in_bytes"].read_text().strip() == str(48 * 1024 * 1024)
    else:
        assert files["memory.max"].read_text().strip() == str(48 * 1024 * 1024)
        if "cpu.weight" in files:
            assert files["cpu.weight"].read_text().strip() == "200"


def test_rlimit_mode_bounds_the_address_space(tasks: Tasks, tmp_path: Path) -> None:
    driver = ProcessDriver(RlimitLimits())
    program = "b = bytearray(200 * 1024 * 1024)"
    spec = make_spec(tmp_path, [sys.executable, "-I", "-S", "-c", program], memory_mb=64)
    handle, status = start_and_wait(driver, tasks, spec)
    assert handle.cgroups == []
    assert status.exit_code == 1 and not status.oom_killed  # MemoryError: rlimits cannot report OOM
    assert "MemoryError" in handle.stderr_path.read_text()


def test_auto_detect_falls_back_to_rlimits_without_cgroups(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "30 1 0:26 / /nonexistent/unified rw - cgroup2 cgroup2 rw\n"
        "31 1 0:27 / /nonexistent/memory rw - cgroup cgroup rw,memory\n"
    )
    assert auto_detect("fallback", mountinfo=str(mountinfo)).describe() == "rlimit"
    (tmp_path / "empty").write_text("")
    assert auto_detect("fallback", mountinfo=str(tmp_path / "empty")).describe() == "rlimit"


def test_auto_detect_leaves_nothing_behind() -> None:
    detected = auto_detect(f"{BASE}-detect")
    bases = [getattr(detected, name, None) for name in ("base", "memory_base", "cpu_base")]
    assert all(not base.exists() for base in bases if isinstance(base, Path))


def test_cgroup2_files_on_a_plain_directory(tmp_path: Path) -> None:
    """This host has no v2 memory controller, so the v2 code is exercised on a plain directory: it
    checks which values are written and how memory.events is read, not the kernel's behaviour."""
    root = tmp_path / "unified"
    limits = Cgroup2Limits(str(root), "w1")
    machine = limits.base / "m1"
    machine.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    for level in (root, root / "fauxmad", limits.base):
        (level / "cgroup.procs").write_text("")
        (level / "cgroup.subtree_control").write_text("")
    for name in ("memory.max", "memory.swap.max", "cpu.weight"):  # the kernel would create these
        (machine / name).write_text("max")
    limits.setup()
    assert (root / "cgroup.subtree_control").read_text() == "+memory +cpu"
    [cgroup] = limits.prepare("m1", 32, 3)
    assert cgroup == str(machine)
    assert (machine / "memory.max").read_text() == str(32 * 1024 * 1024)
    assert (machine / "memory.swap.max").read_text() == "0"
    assert (machine / "cpu.weight").read_text() == "300"
    (machine / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\n")
    assert not limits.oom_killed([cgroup], signal.SIGKILL)
    (machine / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert limits.oom_killed([cgroup], None)
    with pytest.raises(ValueError):
        limits.prepare("../escape", 32, 1)


def test_a_cgroup2_mount_without_favordynmods_gets_a_one_line_hint(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n")
    hint = slow_migration_hint(str(mountinfo))
    assert hint is not None and "mount -o remount,favordynmods /sys/fs/cgroup/unified" in hint and "\n" not in hint
    mountinfo.write_text("41 31 0:38 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw,nsdelegate,favordynmods\n")
    assert slow_migration_hint(str(mountinfo)) is None
    assert slow_migration_hint(str(tmp_path / "no-such-file")) is None  # no cgroup2: nothing to say


def test_a_force_destroy_ends_a_machine_whose_workload_it_cannot_name(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    """No `child.pid` to signal (the workload's record lost, or not written yet): the destroy kills the shim's
    session after `KILL_PATIENCE` and returns, instead of waiting forever for a shim whose workload runs on
    (a destroy holds the machine's lock: a CI run's `apps destroy` waited on one until its test timed out)."""
    handle = start(driver, tasks, make_spec(tmp_path, ["sleep", "300"]))
    wait_until(lambda: (Path(handle.workdir) / "child.pid").exists(), "the workload's child.pid", interval=0.01)
    workload = read_pid(Path(handle.workdir) / "child.pid")
    assert workload is not None
    (Path(handle.workdir) / "child.pid").unlink()
    driver._forget_workload((handle.pid, handle.start_ticks))
    run(asyncio.wait_for(driver.destroy(handle, force=True), 30))
    assert not driver.recover(handle)
    wait_until(
        lambda: not Path(f"/proc/{workload}").exists() or "Z" in Path(f"/proc/{workload}/stat").read_text(),
        "the workload gone or a zombie",
        interval=0.01,
    )
