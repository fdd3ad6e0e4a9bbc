"""`exec`: a command run beside a machine's workload, with its environment, working directory and limits.

It joins the machine's cgroups (or gets its RLIMIT_AS) through a few lines of stdlib Python that then exec the
command (`EXEC_LAUNCHER`), so no `preexec_fn` runs in the worker's threaded process; in a sandboxed machine it
enters the sandbox's namespaces and root. It is the worker's child, in a session of its own, killed (its whole
process group) at the timeout; its output is read to the end but only the first `EXEC_MAX_OUTPUT` bytes of each
stream are kept. Its own module: nothing of the driver's watch over the machine's shim is involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal as signals
import subprocess
import time
from pathlib import Path

from bus.contract.machines import EXEC_MAX_OUTPUT, ExecReply
from workers.driver.base import TaskHandle, TaskSpec
from workers.driver.proc import read_pid

CHILD_PID = "child.pid"

# After an exec's command has ended, how long its output may take to reach end of file (a background
# process it left may hold the pipes) before its process group is killed and what was read is kept.
EXEC_DRAIN = 0.5
EXEC_READ_CHUNK = 65536
EXEC_CANNOT_START = 127
# argv: N, N cgroup directories, RLIMIT_AS bytes (0: none), then the command. Run as `python -I -S -c`.
EXEC_LAUNCHER = """
import os, signal, sys
user, n = sys.argv[1], int(sys.argv[2])
cgroups, rlimit, cmd = sys.argv[3 : 3 + n], int(sys.argv[3 + n]), sys.argv[4 + n :]
try:
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    pid = str(os.getpid()).encode()
    for cgroup in cgroups:
        fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)
    if rlimit > 0:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (rlimit, rlimit))
    if user:
        import warnings  # os.execvpe imports it, and the machine's user may not read the stdlib
        uid, _, gid = user.partition(":")
        os.setgroups([])
        os.setgid(int(gid))
        os.setuid(int(uid))
    os.execvpe(cmd[0], cmd, dict(os.environ))
except FileNotFoundError:
    os.write(2, f"fauxmad exec: {cmd[0]}: command not found\\n".encode())
    os._exit(127)
except BaseException as exc:
    os.write(2, f"fauxmad exec: cannot start {cmd[0]!r}: {exc}\\n".encode())
    os._exit(127)  # EXEC_CANNOT_START, as a shell says "command not found"
"""


async def run_beside(
    handle: TaskHandle, spec: TaskSpec, cmd: list[str], timeout: float, *, python: str, rlimit: int
) -> ExecReply:
    """Run `cmd` in the machine's environment, working directory and limits; see the module docstring."""
    argv = [python, "-I", "-S", "-c", EXEC_LAUNCHER, user_of(spec), str(len(handle.cgroups)), *handle.cgroups]
    if spec.sandbox != "none":  # into its namespaces and its root (nsenter forks, so it joins the pid one too)
        sandbox = await sandbox_ready(Path(handle.workdir) / CHILD_PID, [path for _, path in spec.volumes])
        if sandbox is not None:
            cmd = [
                "nsenter",
                "-t",
                str(sandbox),
                "-p",
                "-m",
                "-i",
                "-u",
                "-r",
                "-w",
                "--",
                *cmd,
            ]  # -w: its cwd, run_dir
    proc = await asyncio.create_subprocess_exec(
        *argv,
        str(rlimit),
        *cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=spec.env,
        cwd=spec.run_dir,
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    reads = [asyncio.ensure_future(read_bounded(stream)) for stream in (proc.stdout, proc.stderr)]
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            kill_group(proc.pid)
            await proc.wait()
        done, _ = await asyncio.wait(reads, timeout=EXEC_DRAIN)
        if len(done) < len(reads):  # something it started holds the pipes: its group goes too
            kill_group(proc.pid)
            await asyncio.wait(reads, timeout=EXEC_DRAIN)
    finally:
        if proc.returncode is None:  # cancelled (the worker is stopping): leave nothing behind
            kill_group(proc.pid)
        for read in reads:
            read.cancel()
    outputs = [read.result() if read.done() and not read.cancelled() else (b"", False) for read in reads]
    code = proc.returncode
    return ExecReply(
        exit_code=None if timed_out or code is None or code < 0 else code,
        signal=-code if code is not None and code < 0 else None,
        timed_out=timed_out,
        stdout=outputs[0][0].decode("utf-8", "replace"),
        stderr=outputs[1][0].decode("utf-8", "replace"),
        truncated=outputs[0][1] or outputs[1][1],
    )


async def sandbox_ready(pid_file: Path, paths: list[str], wait: float = 5.0) -> int | None:
    """The sandbox's pid once bwrap has reported it and (seen through its root) bound its volumes: an exec
    right after a start must not run beside the sandbox, nor in it before its mounts are there."""
    deadline = time.monotonic() + wait
    while True:
        pid = read_pid(pid_file)
        if pid is not None and all(os.path.exists(f"/proc/{pid}/root{path}") for path in paths):
            return pid
        if time.monotonic() > deadline:
            return pid
        await asyncio.sleep(0.01)


def user_of(spec: TaskSpec) -> str:
    """The shim's `--user` for this machine: "UID:GID", or "" to run as the worker's own user."""
    return "" if spec.run_as is None else f"{spec.run_as[0]}:{spec.run_as[1]}"


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signals.SIGKILL)


async def read_bounded(stream: asyncio.StreamReader, limit: int = EXEC_MAX_OUTPUT) -> tuple[bytes, bool]:
    """Read `stream` to its end; keep its first `limit` bytes, and say whether there was more."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(EXEC_READ_CHUNK):
        room = limit - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[: max(0, room)]
    return bytes(kept), truncated
