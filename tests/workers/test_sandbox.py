"""Sandboxed machines (`guest.sandbox = "bwrap"`) with the real bwrap, the real driver, shim and launcher.

What a sandbox must hold: the machine sees only its own processes, cannot write outside its own
directories, has a private /tmp and its machine id as host name; and everything a plain machine has
still works inside it: exit codes, signals, stop with escalation, OOM reporting, exec, and the exit
status learned after the shim lost its watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.workers.test_driver import subreaper  # noqa: F401 - a fixture
from workers.driver import sandbox
from workers.driver.base import ExitStatus, TaskHandle, TaskSpec
from workers.driver.limits import Limits, auto_detect
from workers.driver.process import ProcessDriver
from workers.driver.shim import from_sandbox

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}
BASE = f"test-sandbox-{os.getpid()}"

needs_bwrap = pytest.mark.skipif(
    sandbox.bwrap_path() is None, reason="bubblewrap is not installed (Debian: apt-get install bubblewrap)"
)


@pytest.fixture(scope="module")
def limits() -> Iterator[Limits]:
    detected = auto_detect(BASE)
    yield detected
    detected.close()


@pytest.fixture
def driver(limits: Limits) -> Iterator[ProcessDriver]:
    made = ProcessDriver(limits)
    handles: list[TaskHandle] = []
    made.test_handles = handles  # type: ignore[attr-defined]
    yield made
    for handle in handles:  # whatever a test left running: the sandbox's group, then the shim
        workload = _read_pid(Path(handle.workdir) / "child.pid")
        with contextlib.suppress(ProcessLookupError):
            if workload is not None and os.getsid(workload) == workload:
                os.killpg(workload, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            if made.recover(handle):
                os.kill(handle.pid, signal.SIGKILL)
        limits.cleanup(handle.cgroups)
    made.close()


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def spec_for(tmp_path: Path, cmd: list[str], **overrides: object) -> TaskSpec:
    fields: dict[str, object] = {
        "machine_id": f"m{os.urandom(6).hex()}",
        "cmd": cmd,
        "env": dict(ENV),
        "workdir": str(tmp_path / "machine"),
        "memory_mb": 256,
        "cpus": 1,
        "sandbox": "bwrap",
    }
    fields.update(overrides)
    return TaskSpec(**fields)  # type: ignore[arg-type]


def start(driver: ProcessDriver, spec: TaskSpec) -> TaskHandle:
    handle = asyncio.run(driver.start(spec))
    driver.test_handles.append(handle)  # type: ignore[attr-defined]
    return handle


def run_to_end(driver: ProcessDriver, spec: TaskSpec) -> tuple[TaskHandle, ExitStatus]:
    async def go() -> tuple[TaskHandle, ExitStatus]:
        handle = await driver.start(spec)
        driver.test_handles.append(handle)  # type: ignore[attr-defined]
        return handle, await asyncio.wait_for(driver.wait(handle), 20)

    return asyncio.run(go())


def wait_for_file(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------------
# pure parts


def test_bwrap_argv_shares_nothing_but_what_is_listed(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "bin").symlink_to("usr/bin")
    argv = sandbox.bwrap_argv(
        "/usr/bin/bwrap",
        ["python3", "app.py"],
        hostname="m1",
        writable=["/data/m1", "/data/m1"],
        cwd="/data/m1",
        root_dirs=[str(tmp_path / "lib"), str(tmp_path / "bin"), str(tmp_path / "none")],
        etc_files=["/etc/hosts"],
    )
    assert argv[-3:] == ["--", "python3", "app.py"]
    joined = " ".join(argv)
    for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session", "--hostname m1"):
        assert flag in joined
    assert "--unshare-net" not in joined and "--share-net" not in joined  # the host's network: ports
    assert f"--ro-bind {tmp_path / 'lib'} {tmp_path / 'lib'}" in joined
    assert f"--symlink usr/bin {tmp_path / 'bin'}" in joined
    assert str(tmp_path / "none") not in joined
    assert joined.count("--bind /data/m1 /data/m1") == 1  # listed twice, bound once
    assert joined.index("--tmpfs /tmp") < joined.index("--bind /data/m1")  # a machine dir under /tmp stays
    assert "--ro-bind /usr /usr" in joined and "--chdir /data/m1" in joined
    assert joined.index("--bind /data/m1") < joined.index("--remount-ro /")


def test_exit_codes_above_128_from_bwrap_read_as_signals() -> None:
    assert from_sandbox(143, None) == (None, 15)
    assert from_sandbox(137, None) == (None, 9)
    assert from_sandbox(3, None) == (3, None)
    assert from_sandbox(128, None) == (128, None)
    assert from_sandbox(None, 9) == (None, 9)  # bwrap itself killed


def test_a_worker_without_bwrap_refuses_in_plain_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "available", list)
    with pytest.raises(sandbox.SandboxUnavailable, match=r"bubblewrap .* not installed on worker w1"):
        sandbox.check("bwrap", "w1")
    sandbox.check("none", "w1")


# ---------------------------------------------------------------------------------------------------
# the real thing


@needs_bwrap
def test_the_machine_sees_only_its_own_processes_and_its_own_name(driver: ProcessDriver, tmp_path: Path) -> None:
    spec = spec_for(tmp_path, ["sh", "-c", "ls /proc | grep -c '^[0-9]'; hostname; echo $$"])
    handle, status = run_to_end(driver, spec)
    assert status.success, handle.stderr_path.read_text()
    count, hostname, pid = handle.stdout_path.read_text().split()
    assert int(count) <= 4  # bwrap's init, the shell, ls and grep: never the host's hundreds
    assert hostname == spec.machine_id
    assert int(pid) <= 3


@needs_bwrap
def test_the_machine_writes_only_its_own_directories(driver: ProcessDriver, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    script = (
        "echo mine > own.txt && echo tmp > /tmp/private.txt && cat /tmp/private.txt;"
        f" for p in /usr/fauxmad-x /etc/fauxmad-x {outside}/x /root/fauxmad-x; do"
        "   if echo x > $p 2>/dev/null; then echo WROTE $p; else echo refused $p; fi; done;"
        f" ls {outside} 2>&1 | head -1"
    )
    handle, status = run_to_end(driver, spec_for(tmp_path, ["sh", "-c", script]))
    out = handle.stdout_path.read_text()
    assert status.success, handle.stderr_path.read_text()
    assert "WROTE" not in out
    assert out.count("refused") == 4
    assert (Path(handle.workdir) / "own.txt").read_text() == "mine\n"
    assert "tmp" in out.splitlines()[0]
    assert not Path("/tmp/private.txt").exists()  # the machine's /tmp is its own
    assert not any(outside.iterdir())
    assert not Path("/etc/fauxmad-x").exists() and not Path("/usr/fauxmad-x").exists()


@needs_bwrap
def test_exit_code_and_stop_with_sigterm(driver: ProcessDriver, tmp_path: Path) -> None:
    _, status = run_to_end(driver, spec_for(tmp_path, ["sh", "-c", "exit 3"]))
    assert status.exit_code == 3 and status.signal is None

    handle = start(driver, spec_for(tmp_path, ["sh", "-c", "touch ready; exec sleep 30"], workdir=str(tmp_path / "m2")))
    wait_for_file(Path(handle.workdir) / "ready")  # a SIGTERM while bwrap still sets up ends bwrap, not sleep
    status = asyncio.run(driver.stop(handle, 10, signal.SIGTERM))
    assert status.signal == signal.SIGTERM and status.exit_code is None
    assert not driver.recover(handle)


@needs_bwrap
def test_a_handled_sigterm_keeps_the_workloads_own_exit_code(driver: ProcessDriver, tmp_path: Path) -> None:
    """The signal reaches the workload, not the outer bwrap: its own exit code comes through."""
    script = "trap 'echo bye; exit 7' TERM; touch ready; while :; do sleep 0.05; done"
    handle = start(driver, spec_for(tmp_path, ["sh", "-c", script]))
    wait_for_file(Path(handle.workdir) / "ready")
    status = asyncio.run(driver.stop(handle, 10, signal.SIGTERM))
    assert status.exit_code == 7 and status.signal is None
    assert "bye" in handle.stdout_path.read_text()


@needs_bwrap
def test_stop_escalates_to_sigkill(driver: ProcessDriver, tmp_path: Path) -> None:
    handle = start(driver, spec_for(tmp_path, ["sh", "-c", 'trap "" TERM; touch ready; sleep 30']))
    wait_for_file(Path(handle.workdir) / "ready")
    status = asyncio.run(driver.stop(handle, 0.5, signal.SIGTERM))
    assert status.signal == signal.SIGKILL


@needs_bwrap
def test_memory_over_the_limit_is_oom_killed_inside(limits: Limits, driver: ProcessDriver, tmp_path: Path) -> None:
    if limits.mode == "rlimit":
        pytest.skip(f"no usable cgroups on this host (auto_detect chose {limits.describe()})")
    program = "b = bytearray(200 * 1024 * 1024); import time; time.sleep(1)"
    spec = spec_for(tmp_path, ["python3", "-I", "-S", "-c", program], memory_mb=32)
    _, status = run_to_end(driver, spec)
    assert status.oom_killed and status.signal == signal.SIGKILL


@needs_bwrap
def test_exec_enters_the_sandbox(driver: ProcessDriver, tmp_path: Path) -> None:
    handle = start(driver, spec_for(tmp_path, ["sh", "-c", "echo inside > /tmp/mark; touch ready; exec sleep 30"]))
    wait_for_file(Path(handle.workdir) / "ready")
    spec = spec_for(tmp_path, ["sleep"], machine_id=Path(handle.workdir).name)
    reply = asyncio.run(
        driver.exec(handle, spec, ["sh", "-c", "cat /tmp/mark; hostname; ls /proc | grep -c '^[0-9]'"], 10)
    )
    assert reply.exit_code == 0, reply.stderr
    mark, _hostname, count = reply.stdout.split()
    assert mark == "inside"  # the machine's private /tmp, so its mount namespace
    assert int(count) <= 6  # its processes and the exec's, not the host's
    asyncio.run(driver.destroy(handle, force=True))


@needs_bwrap
def test_the_launcher_path_and_the_direct_path_both_sandbox(driver: ProcessDriver, tmp_path: Path) -> None:
    """Starts go through the launcher (forked shims); a request too big for it starts the shim directly."""
    big_env = {**ENV, **{f"BIG{i}": "x" * 10_000 for i in range(30)}}
    for name, env in (("launched", ENV), ("direct", big_env)):
        spec = spec_for(tmp_path, ["sh", "-c", "hostname"], env=env, workdir=str(tmp_path / name))
        spec = msgspec.structs.replace(spec, machine_id=f"m{name}")
        handle, status = run_to_end(driver, spec)
        assert status.success, handle.stderr_path.read_text()
        assert handle.stdout_path.read_text().strip() == f"m{name}"


# ---------------------------------------------------------------------------------------------------
# crash safety: the same shim, the same files


@needs_bwrap
@pytest.mark.usefixtures("subreaper")
def test_a_sandboxed_task_survives_its_worker_and_is_stopped_by_the_next(limits: Limits, tmp_path: Path) -> None:
    from tests.workers.test_driver import kill_starter, start_elsewhere

    script = "trap 'exit 9' TERM; touch ready; while :; do sleep 0.05; done"
    starter, handle = start_elsewhere(spec_for(tmp_path, ["sh", "-c", script]))
    kill_starter(starter)  # kill -9 of the worker that started it
    wait_for_file(Path(handle.workdir) / "ready")
    driver = ProcessDriver(limits)  # the restarted worker
    try:
        assert driver.recover(handle) and driver.inspect(handle).running
        status = asyncio.run(driver.stop(handle, 10, signal.SIGTERM))
        assert status.exit_code == 9 and not status.lost  # the workload's own exit, through the new watcher
    finally:
        driver.close()


@needs_bwrap
def test_a_shim_killed_under_a_sandbox_reports_it_lost_and_ends_it(driver: ProcessDriver, tmp_path: Path) -> None:
    handle = start(driver, spec_for(tmp_path, ["sleep", "30"]))
    wait_for_file(Path(handle.workdir) / "child.pid")
    group = _read_pid(Path(handle.workdir) / "child.pid")
    assert group is not None and os.getsid(group) == group  # the sandbox's own session
    os.kill(handle.pid, signal.SIGKILL)
    status = asyncio.run(asyncio.wait_for(driver.wait(handle), 10))
    assert status.lost and not status.success
    deadline = time.monotonic() + 10
    while _alive(group):  # reported as ended, so it must have ended
        assert time.monotonic() < deadline, "the sandbox outlived a report that it ended"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
