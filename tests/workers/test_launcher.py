"""The launcher (fork server) behind `ProcessDriver.start`, with real processes.

Grouped by behaviour: shims come from the launcher, the launcher's death costs no machine and no
start, the launcher leaves no zombies and records a shim's own end, and the wire format.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.helpers import wait_until
from tests.workers import test_driver as shared
from tests.workers.test_driver import BASE, REPO, Tasks, gone, make_spec, read_pid, run, start
from workers.driver import fork_client as launcher_client
from workers.driver.base import ExitStatus, TaskHandle
from workers.driver.fork_server import (
    ABANDONED,
    SPARES,
    decode_reply,
    decode_request,
    encode_error,
    encode_ok,
    encode_request,
    make_request,
)
from workers.driver.limits import Limits
from workers.driver.process import ProcessDriver

# test_driver's fixtures: the run's limits, the task tracker that cleans up, the subreaper
limits, tasks, subreaper = shared.limits, shared.tasks, shared.subreaper
WAIT_FOR_GO = ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 7"]


def wait_for_go(exit_code: str) -> list[str]:
    """A workload that runs until `finish` (a `go` file in its directory), then exits with `exit_code` (a shell
    word): alive while a test reads which process started it, which one that exits at once is not."""
    return ["sh", "-c", f"while [ ! -e go ]; do sleep 0.02; done; exit {exit_code}"]


@pytest.fixture
def driver(limits: Limits) -> Iterator[ProcessDriver]:
    made = ProcessDriver(limits)
    yield made
    made.close()


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of every process whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.append((int(entry), fields[0].decode()))
    return found


def finish(driver: ProcessDriver, handle: TaskHandle) -> ExitStatus:
    (Path(handle.workdir) / "go").touch()
    return run(asyncio.wait_for(driver.wait(handle), 10))


# ---------------------------------------------------------------------------------------------------
# shims come from the launcher


def test_shims_are_forked_by_one_launcher_in_sessions_of_their_own(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    first = start(driver, tasks, make_spec(tmp_path / "a", WAIT_FOR_GO))
    second = start(driver, tasks, make_spec(tmp_path / "b", WAIT_FOR_GO))
    launcher = driver.launcher_pid
    assert launcher is not None and launcher != os.getpid()
    for handle in (first, second):
        assert parent_of(handle.pid) == launcher
        # `start` returns once the shim is forked; it is in its own session before it forks the workload
        wait_until(
            lambda: read_pid(Path(handle.workdir) / "child.pid") is not None,  # noqa: B023
            "the pid in the workload's child.pid",
            interval=0.01,
        )
        assert os.getsid(handle.pid) == handle.pid  # not the launcher's session, not ours
        assert driver.recover(handle)
    assert os.getsid(launcher) == launcher  # its own session: no terminal signal reaches it
    assert finish(driver, first).exit_code == 7 and finish(driver, second).exit_code == 7


def test_an_error_reply_raises_like_popen_and_keeps_the_launcher(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    start(driver, tasks, make_spec(tmp_path / "ok", ["true"]))
    launcher = driver.launcher_pid
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as raised:
        run(driver.start(make_spec(tmp_path / "bad", ["true"], cwd=str(missing))))
    assert raised.value.filename == str(missing)
    assert driver.launcher_pid == launcher
    assert launcher is not None
    handle = start(driver, tasks, make_spec(tmp_path / "again", wait_for_go("4")))
    assert parent_of(handle.pid) == launcher  # the launcher still starts machines
    assert finish(driver, handle).exit_code == 4


# ---------------------------------------------------------------------------------------------------
# the launcher's death costs no machine and no start


@pytest.mark.usefixtures("subreaper")
def test_a_killed_launcher_loses_no_machine_and_start_falls_back_then_respawns(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = start(driver, tasks, make_spec(tmp_path / "before", WAIT_FOR_GO))
    launcher = driver.launcher_pid
    assert launcher is not None
    wait_until(
        lambda: read_pid(Path(before.workdir) / "child.pid") is not None,
        "the pid in the workload's child.pid",
        interval=0.01,
    )
    wait_until(lambda: len(children_of(launcher)) == 1 + SPARES, "the launcher's children", interval=0.01)
    spares = [pid for pid, _ in children_of(launcher) if pid != before.pid]
    os.kill(launcher, signal.SIGKILL)
    wait_until(lambda: gone(launcher), "the launcher gone", interval=0.01)
    for spare in spares:  # they read end of file and exit, orphaned to us
        assert os.waitstatus_to_exitcode(os.waitpid(spare, 0)[1]) == ABANDONED
    assert driver.recover(before)  # the machine outlives its launcher

    with caplog.at_level(logging.WARNING, logger=launcher_client.__name__):
        direct = start(driver, tasks, make_spec(tmp_path / "direct", WAIT_FOR_GO))
    assert parent_of(direct.pid) == os.getpid()  # spawned the direct way
    assert len(caplog.records) == 1 and "launcher is gone" in caplog.records[0].getMessage()

    after = start(driver, tasks, make_spec(tmp_path / "after", WAIT_FOR_GO))
    assert driver.launcher_pid not in (None, launcher)
    assert parent_of(after.pid) == driver.launcher_pid
    assert [finish(driver, handle).exit_code for handle in (before, direct, after)] == [7, 7, 7]


def test_a_launcher_that_cannot_start_means_direct_starts(
    limits: Limits, tasks: Tasks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(launcher_client, "BOOTSTRAP", "import sys; sys.exit(3)")
    driver = ProcessDriver(limits)
    with caplog.at_level(logging.WARNING, logger=launcher_client.__name__):
        handles = [start(driver, tasks, make_spec(tmp_path / str(i), wait_for_go("5"))) for i in range(5)]
    assert [parent_of(handle.pid) for handle in handles] == [os.getpid()] * 5  # every one spawned the direct way
    statuses = [finish(driver, handle) for handle in handles]
    assert {status.exit_code for status in statuses} == {5}
    # one warning per failed launcher, then it stops trying
    assert len(caplog.records) == launcher_client.MAX_FAILURES
    assert "from now on" in caplog.records[-1].getMessage()
    assert driver.launcher_pid is None


STARTER = """
import asyncio, sys, msgspec
from workers.driver.base import TaskSpec
from workers.driver.limits import auto_detect
from workers.driver.process import ProcessDriver

driver = ProcessDriver(auto_detect(sys.argv[2]))
handles = [asyncio.run(driver.start(msgspec.json.decode(spec, type=TaskSpec))) for spec in sys.argv[3:]]
sys.stdout.write(msgspec.json.encode({"launcher": driver.launcher_pid, "handles": handles}).decode() + "\\n")
sys.stdout.flush()
sys.stdin.read()  # until killed
"""


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.usefixtures("subreaper")
def test_kill9_of_the_worker_ends_its_launcher_and_no_machine(limits: Limits, tasks: Tasks, tmp_path: Path) -> None:
    specs = [make_spec(tmp_path / str(i), WAIT_FOR_GO) for i in range(3)]
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, "", BASE, *(msgspec.json.encode(spec).decode() for spec in specs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert starter.stdout is not None and starter.stdin is not None
    started = json.loads(starter.stdout.readline())
    handles = [tasks.add(TaskHandle(**handle)) for handle in started["handles"]]
    launcher = started["launcher"]
    assert all(parent_of(handle.pid) == launcher for handle in handles)

    starter.kill()
    starter.wait()
    starter.stdin.close()
    starter.stdout.close()
    wait_until(
        lambda: gone(launcher), "the launcher gone", interval=0.01
    )  # end of file on its socket: it exits with its worker
    os.waitpid(launcher, 0)  # orphaned to us (a subreaper), so ours to reap

    restarted = ProcessDriver(limits)  # the worker's successor re-adopts every machine
    assert all(restarted.recover(handle) for handle in handles)
    assert [finish(restarted, handle).exit_code for handle in handles] == [7, 7, 7]


@pytest.mark.usefixtures("subreaper")
def test_close_stops_the_launcher_and_machines_keep_running(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    handle = start(driver, tasks, make_spec(tmp_path, WAIT_FOR_GO))
    launcher = driver.launcher_pid
    assert launcher is not None
    driver.close()
    assert gone(launcher)  # exited and reaped by close()
    assert driver.recover(handle)
    assert finish(ProcessDriver(driver.limits), handle).exit_code == 7


# ---------------------------------------------------------------------------------------------------
# no zombies; a shim's own end


def test_the_launcher_reaps_every_shim(driver: ProcessDriver, tasks: Tasks, tmp_path: Path) -> None:
    async def go() -> list[ExitStatus]:
        specs = [make_spec(tmp_path / str(i), ["sh", "-c", f"exit {i}"]) for i in range(8)]
        handles = [tasks.add(await driver.start(spec)) for spec in specs]
        return await asyncio.wait_for(asyncio.gather(*(driver.wait(handle) for handle in handles)), 20)

    assert [status.exit_code for status in run(go())] == list(range(8))
    launcher = driver.launcher_pid
    assert launcher is not None
    # reaped, not zombies: what is left are the spares, waiting for the next starts
    wait_until(
        lambda: [state for _, state in children_of(launcher)] == ["S"] * SPARES, "the spares asleep", interval=0.01
    )


REAP_A_FAILED_SHIM = """
import os, sys, time
from workers.driver import fork_server as launcher
started, failed = sys.argv[1], sys.argv[2]
open(os.path.join(started, "child.pid"), "w").write("1")  # this one got as far as its workload
shims = {}
for workdir, code in ((started, 9), (failed, 3)):
    pid = os.fork()
    if pid == 0:
        os._exit(code)
    shims[pid] = workdir
while shims:
    launcher.reap(shims)
    time.sleep(0.01)
"""


@pytest.mark.fleet  # starts processes of its own
def test_a_shim_that_never_started_its_workload_gets_its_own_status_in_exit_json(tmp_path: Path) -> None:
    """The driver cannot wait for a shim that is the launcher's child: the launcher writes its status."""
    started, failed = tmp_path / "started", tmp_path / "failed"
    started.mkdir()
    failed.mkdir()
    subprocess.run(
        [
            *(sys.executable, "-I", "-S", "-c"),
            f"import sys; sys.path.insert(0, {str(REPO)!r})\n{REAP_A_FAILED_SHIM}",
            *(str(started), str(failed)),
        ],
        check=True,
        timeout=20,
    )
    record = json.loads((failed / "exit.json").read_text())
    assert record["exit_code"] == 3 and record["signal"] is None
    assert not (started / "exit.json").exists()  # left to the driver: it kills the workload, reports lost


# The launcher's loop, one turn: a shim of the machine's run before has ended (no child.pid: it never started its
# workload, so the launcher records its end), and the request for the machine's next run is read before the
# wakeup fd says so (the worker sees a shim end through its pidfd a moment before the launcher gets SIGCHLD). The
# request's cwd does not exist: the workdir is cleared, then the request fails, and no shim of it runs.
SERVE_BEFORE_THE_WAKEUP = """
import os, socket, sys, time
from workers.driver import fork_server as launcher
workdir = sys.argv[1]
os.makedirs(workdir)
ended = os.fork()
if ended == 0:
    os._exit(3)
while open(f"/proc/{ended}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.001)
shims = {ended: workdir}
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
request = launcher.make_request(
    workdir=workdir, cwd=workdir + "/gone", cmd=["true"], env={}, cgroups=[], rlimit_as=None
)
ours.send(launcher.encode_request(request))
assert launcher._serve_one(theirs.fileno(), shims, {})
launcher.reap(shims)  # the loop's next turn, with the wakeup fd
"""


@pytest.mark.fleet  # starts processes of its own
def test_a_shim_that_ended_is_recorded_before_the_next_run_clears_its_workdir(tmp_path: Path) -> None:
    """The record of a shim of the run before is written before the next run's request clears the workdir, never
    after (it landed in the new run's directory as the new run's end, and its temporary file clashed with the new
    shim's own: 'cannot write exit.json', seen in CI). Fails without the reap before each request."""
    workdir = tmp_path / "machine"
    subprocess.run(
        [
            *(sys.executable, "-I", "-S", "-c"),
            f"import sys; sys.path.insert(0, {str(REPO)!r})\n{SERVE_BEFORE_THE_WAKEUP}",
            str(workdir),
        ],
        check=True,
        timeout=20,
    )
    assert not (workdir / "exit.json").exists(), (workdir / "exit.json").read_text()


def test_a_shim_killed_right_after_start_is_reported_consistently(
    driver: ProcessDriver, tasks: Tasks, tmp_path: Path
) -> None:
    """Killed before it forked its workload (usually: the fork is a moment away), the launcher records
    the shim's own end and `wait` waits for that; killed after, the workload is killed and it is lost."""
    for attempt in range(5):
        handle = start(driver, tasks, make_spec(tmp_path / str(attempt), ["sleep", "30"]))
        os.kill(handle.pid, signal.SIGKILL)
        status = run(asyncio.wait_for(driver.wait(handle), 10))
        workload = read_pid(Path(handle.workdir) / "child.pid")
        if workload is None:
            assert status.signal == signal.SIGKILL and not status.lost
        else:
            assert status.lost
            wait_until(lambda: gone(workload), "the workload gone", interval=0.01)  # noqa: B023 - used at once
        assert json.loads(handle.status_path.read_text())["finished_at"] == status.finished_at


# ---------------------------------------------------------------------------------------------------
# wire format


def test_requests_and_replies_round_trip() -> None:
    request = make_request(
        workdir="/w/m1",
        cwd="/srv/app dir",
        cmd=["sh", "-c", "echo a=b; exit 3", ""],
        env={"A": "1=2", "EMPTY": "", "UTF": "é"},
        cgroups=["/sys/fs/cgroup/memory/x", "/sys/fs/cgroup/cpu/x"],
        rlimit_as=64 << 20,
    )
    decoded = decode_request(encode_request(request))
    assert (decoded.cwd, decoded.args.workdir, decoded.args.cmd) == (request.cwd, "/w/m1", request.args.cmd)
    assert (decoded.args.env, decoded.args.cgroups, decoded.args.rlimit_as) == (
        request.args.env,
        request.args.cgroups,
        64 << 20,
    )
    bare = make_request(workdir="/w", cwd="/", cmd=["true"], env={}, cgroups=[], rlimit_as=None)
    assert decode_request(encode_request(bare)).args.rlimit_as is None
    with pytest.raises(ValueError):
        encode_request(make_request(workdir="/w", cwd="/", cmd=["a\0b"], env={}, cgroups=[], rlimit_as=None))
    with pytest.raises((ValueError, IndexError)):
        decode_request(b"/w\0/\0\0" + b"2\0/only-one")

    assert decode_reply(encode_ok(42, 1234)) == (42, 1234)
    with pytest.raises(PermissionError) as raised:
        decode_reply(encode_error(errno.EACCES, "Permission denied", "/w/stdout.log"))
    assert raised.value.filename == "/w/stdout.log"
    with pytest.raises(ValueError):
        decode_reply(b"what")
