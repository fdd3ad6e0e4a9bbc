"""The per-machine shim: a tiny supervisor that outlives the worker and records how the workload ended.

Why it exists: a machine must survive a worker crash or restart, and its exit status must still be
learned afterwards. Only a process's parent can read its wait status, so the parent of every workload
is this shim rather than the worker. The shim forks the workload, writes `child.pid`, waits, and
leaves `exit.json` behind; the worker (or its successor after a restart) watches the shim with a
pidfd and reads the file. Nothing ties the shim to the worker: it runs in its own session, holds no
pipe to it, and its stdio are the machine's log files.

Two ways in, one body (`run`): the worker's launcher (workers/driver/fork_server.py) forks a shim from an
interpreter that is already running and calls `run` in the child, which costs well under a
millisecond; `python -I -S shim.py ...` (`main`) is the same shim started from scratch, used when
there is no launcher.

Key decisions:

- STDLIB ONLY, no project imports, run as `python -I -S shim.py`: it starts in ~15 ms and cannot be
  broken by the worker's virtualenv or environment. For the same reason it avoids json, argparse and
  contextlib (each costs milliseconds of imports).
- The shim ignores SIGTERM/SIGINT/SIGHUP/SIGQUIT by blocking them (they stay pending, never
  delivered). The workload gets its own process group (pgid = its pid; both sides call setpgid so
  there is no race) and the driver signals that group. A group shared with the shim would not do:
  SIGKILL cannot be ignored and would take the shim (and the exit status) with it.
- Blocking rather than SIG_IGN also closes a race: the fork child inherits the mask, so a SIGTERM
  sent to its group between fork and exec stays pending instead of being discarded, and is acted on
  the moment the child restores default dispositions and an empty mask. It must restore them
  because ignored signals and the mask survive exec (Python itself ignores SIGPIPE and SIGXFSZ).
- The shim waits with `waitid(WNOWAIT)`, writes `exit.json` and only then reaps: while no status file
  exists, the workload pid is held (as a zombie at worst), so the driver never signals a reused pid.
- Files are written atomically (tmp + fsync + rename + fsync of the directory): a reader sees either
  nothing or a whole record.
- The workload's environment is passed in (`Args.env`), never read from `os.environ` inside `run`: a
  launcher-forked shim carries the launcher's environment, not the machine's.

- A sandboxed machine (`--sandbox bwrap`, see workers/driver/sandbox.py): CMD is a bwrap command line. The
  shim hands bwrap a pipe for `--info-fd`, reads the sandbox's pid from it and writes that to
  `child.pid` (the sandbox is a process group of its own, `--new-session`): signals reach the workload,
  not the outer bwrap. bwrap's init reports a death by signal N as exit code 128 + N; the shim records
  it as the signal, as for a plain machine.

- With `--user UID:GID` the workload drops to that user (no supplementary groups) after joining its
  cgroups and before exec: the worker's files (its credentials, its LMDB) are not readable to it.

Usage: shim.py --workdir DIR [--cgroup PATH]... [--rlimit-as BYTES] [--sandbox bwrap] [--user UID:GID] -- CMD [ARG...]
Run that way, the workload's environment is the shim's own environment; its cwd is the shim's cwd.
"""

from __future__ import annotations

import os
import signal
import sys
import time

IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
EXEC_FAILED = 127
USAGE = 2


class Args:
    """What to run and where to record it: the parsed command line (argparse would cost a few ms of
    start-up for four options), or a launcher's decoded request."""

    def __init__(self) -> None:
        self.workdir = ""
        self.cgroups: list[str] = []
        self.rlimit_as: int | None = None
        self.sandbox = False  # CMD is a bwrap command line (see the module docstring)
        self.user = ""  # "UID:GID" the workload runs as; "": the shim's own
        self.cmd: list[str] = []
        self.env: dict[str, str] = {}


def parse_args(argv: list[str]) -> Args:
    args = Args()
    i = 0
    while i < len(argv):
        opt = argv[i]
        if opt == "--":
            args.cmd = argv[i + 1 :]
            break
        if i + 1 >= len(argv):
            raise ValueError(f"option {opt} needs a value")
        value = argv[i + 1]
        if opt == "--workdir":
            args.workdir = value
        elif opt == "--cgroup":
            args.cgroups.append(value)
        elif opt == "--rlimit-as":
            args.rlimit_as = int(value)
        elif opt == "--sandbox":
            args.sandbox = value == "bwrap"
        elif opt == "--user":
            args.user = value
        else:
            raise ValueError(f"unknown option {opt}")
        i += 2
    if not args.workdir or not args.cmd:
        raise ValueError("--workdir and a command after -- are required")
    return args


def temporary(path: str) -> str:
    """This process's temporary file for `path` (see `write_atomic`)."""
    return f"{path}.tmp.{os.getpid()}"


def write_atomic(path: str, data: bytes, durable: bool) -> None:
    """Write `path` whole or not at all. The temporary file is the writer's own (`<path>.tmp.<pid>`): a shim
    and the launcher may both write a run's `exit.json`, and a clearing of the directory must not take a
    temporary file from under a writer that is about to rename it."""
    tmp = temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    if durable:
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def reset_signals() -> None:
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:  # noqa: SIM105 - contextlib would add to the start-up time
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # signals the C library reserves (e.g. 32, 33) cannot be changed
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def join_cgroups(cgroups: list[str]) -> None:
    pid = str(os.getpid()).encode()
    for cgroup in cgroups:
        fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
        try:
            os.write(fd, pid)
        finally:
            os.close(fd)


def drop_to(user: str) -> None:
    """Become UID:GID for good (groups first: once the uid is dropped it may no longer change them)."""
    import warnings  # noqa: F401 - os.execvpe imports it, and the machine's user may not read the stdlib

    uid, _, gid = user.partition(":")
    os.setgroups([])
    os.setgid(int(gid))
    os.setuid(int(uid))


def run_child(args: Args) -> None:
    """In the forked child: become the workload. Never returns."""
    try:
        reset_signals()
        os.setpgid(0, 0)
        join_cgroups(args.cgroups)
        if args.rlimit_as is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (args.rlimit_as, args.rlimit_as))
        if args.user:
            drop_to(args.user)
        os.execvpe(args.cmd[0], args.cmd, args.env)
    except BaseException as exc:  # anything at all: the child must not fall back into the shim
        try:
            os.write(2, f"fauxmad shim: cannot start {args.cmd[0]!r}: {exc}\n".encode())
        finally:
            os._exit(EXEC_FAILED)


def wait_child(pid: int) -> tuple[int | None, int | None]:
    """Wait for the child to end without reaping it; return (exit_code, signal)."""
    while True:
        try:
            result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except InterruptedError:
            continue
        if result is None:  # only possible with WNOHANG, which is not set
            continue
        if result.si_code == os.CLD_EXITED:
            return result.si_status, None
        return None, result.si_status  # CLD_KILLED or CLD_DUMPED


def exit_record(exit_code: int | None, sig: int | None, finished_at: float) -> bytes:
    """The exit.json document. Formatted by hand: importing json would cost ~5 ms of start-up."""

    def number(value: int | None) -> str:
        return "null" if value is None else str(int(value))

    fields = f'"exit_code": {number(exit_code)}, "signal": {number(sig)}, "finished_at": {finished_at!r}'
    return ("{" + fields + "}\n").encode()


def reap(pid: int) -> None:
    while True:
        try:
            os.waitpid(pid, 0)
            return
        except InterruptedError:
            continue
        except ChildProcessError:
            return


def sandbox_pid(fd: int) -> int | None:
    """The sandbox's pid from bwrap's `--info-fd` JSON (`{"child-pid": N, ...}`), read by hand (no json
    import); None if bwrap ended without writing it."""
    data = b""
    while b"}" not in data:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    key = b'"child-pid":'
    at = data.find(key)
    if at < 0:
        return None
    digits = data[at + len(key) :].lstrip().split(b",")[0].split(b"}")[0].strip()
    return int(digits) if digits.isdigit() else None


def await_own_group(pid: int, patience: float = 5.0) -> None:
    """Return once `pid` leads its own process group (bwrap reports the sandbox's pid a moment before the
    sandbox calls setsid): a signal sent to that group before then would find no group and be lost."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                return
        except ProcessLookupError:
            return  # already gone: its end reaches the shim as bwrap's exit
        time.sleep(0.0002)


def from_sandbox(exit_code: int | None, sig: int | None) -> tuple[int | None, int | None]:
    """bwrap's init exits 128 + N when the workload died of signal N: record that as the signal."""
    if exit_code is not None and 128 < exit_code <= 128 + 64:
        return None, exit_code - 128
    return exit_code, sig


def run(args: Args) -> int:
    """The shim's whole job, in this process: fork the workload, record its pid and its end. Returns
    the shim's own exit status (non-zero when a file could not be written)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    info_r = info_w = -1
    if args.sandbox:
        info_r, info_w = os.pipe()
        args.cmd = [args.cmd[0], "--info-fd", str(info_w), *args.cmd[1:]]
    pid = os.fork()
    if pid == 0:
        if info_w >= 0:
            os.close(info_r)
            os.set_inheritable(info_w, True)
        run_child(args)
    try:  # noqa: SIM105 - contextlib would add to the start-up time
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child already exec'd (EACCES) or set it itself: either way it has its group
    group = pid
    if info_w >= 0:
        os.close(info_w)
        group = sandbox_pid(info_r) or pid  # no pid: bwrap failed before it made the sandbox
        os.close(info_r)
        await_own_group(group)
    status = 0
    try:
        write_atomic(os.path.join(args.workdir, "child.pid"), str(group).encode(), durable=False)
    except OSError as exc:  # keep supervising: the exit status matters more than signalling
        os.write(2, f"fauxmad shim: cannot write child.pid: {exc}\n".encode())
        status = 1
    exit_code, sig = wait_child(pid)
    if args.sandbox:
        exit_code, sig = from_sandbox(exit_code, sig)
    try:
        record = exit_record(exit_code, sig, time.time())
        write_atomic(os.path.join(args.workdir, "exit.json"), record, durable=True)
    except OSError as exc:  # the driver will report the task as lost
        os.write(2, f"fauxmad shim: cannot write exit.json: {exc}\n".encode())
        status = 1
    reap(pid)
    return status


def main(argv: list[str]) -> int:
    """`python -I -S shim.py ...`: the command line says what to run, the environment is the workload's."""
    try:
        args = parse_args(argv)
    except ValueError as exc:
        os.write(2, f"fauxmad shim: {exc}\n".encode())
        return USAGE
    args.env = dict(os.environ)
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
