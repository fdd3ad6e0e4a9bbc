"""The launcher: a fork server that starts shims for one worker without starting an interpreter each time.

Why it exists: `python -I -S shim.py` costs ~20-30 ms of CPU per machine start, nearly all of it
interpreter start-up, and on a small host that competes with the next create. The launcher is one
long-lived `python -I -S` per `ProcessDriver` that already holds the shim's code: per request it
forks, and the child becomes the shim exactly as a fresh one would (new session, the machine's log
files as stdout/stderr, /dev/null as stdin, no other fds, the machine's cwd, then `shim.run`).
A start then costs a fork and a few syscalls.

Key decisions:

- STDLIB ONLY besides `workers.shim` (itself stdlib only), run as `python -I -S`: like the shim, it
  must not depend on the worker's virtualenv or environment. Its own start-up (~30 ms) is paid once.
  Few imports (no typing, no contextlib) and a frozen heap: a fork copies the page tables of all
  that is mapped, and every page either side writes to afterwards, and on a VM that is the cost.
- Machines outlive the launcher: each shim calls setsid, and nothing of the launcher is left open
  in it. The launcher exits when its request socket reaches end of file, which the kernel delivers
  the moment the worker dies, however it dies. (No PR_SET_PDEATHSIG: it fires when the *thread*
  that spawned the launcher ends, which would kill a healthy launcher started from a thread pool.)
- The reply follows the fork at once, so the driver's `start` returns before the child has even run:
  its setsid and redirections come a moment later, always before it forks the workload (so
  `child.pid` names a process in the shim's session, which is what the driver checks).
- Fallible set-up happens in the launcher before the fork (decoding, opening the logs, chdir), so a
  bad request gets an error reply, as `subprocess.Popen` would raise, instead of a dead shim.
- No duplicate machines: the child waits for one byte (`GO`) that the launcher writes only after
  its reply is sent. If the launcher dies in between, the child reads end of file and exits without
  starting anything, so a worker that got no reply can safely fall back to starting the shim itself.
- The launcher reaps its shims (SIGCHLD through a wakeup fd, handled in the main loop, so reaping
  never interleaves with a launch). The worker cannot `waitid` them, so a shim that ended without
  writing `exit.json` and never started its workload gets one from the launcher, holding the shim's
  own wait status, written *before* the zombie is reaped: the driver waits for that reaping before it
  decides, and `exit.json` stays the single source of truth. A shim that died under a running
  workload is left to the driver, which kills that workload and reports the task as lost.
- `start_ticks` is read by the launcher before it replies: until it reaps the shim (later, in its own
  loop) the pid cannot be reused, so the value is always the shim's.

Wire format (one SOCK_SEQPACKET message each way, fields NUL-separated; exec arguments cannot hold NUL):
request `workdir, cwd, rlimit_as or "", N, N cgroups, M, M "KEY=VALUE", cmd...`;
reply `ok PID START_TICKS` or `err ERRNO MESSAGE` + NUL + the file it is about (may be empty).
"""

from __future__ import annotations

import errno
import gc
import os
import select
import signal
import sys
import time

from workers import shim

MAX_REQUEST = 256 * 1024  # bigger requests (a huge environment) are started the direct way
GO = b"g"
ABANDONED = 125  # a child whose launcher died before saying GO: it started nothing
FIELD_SEP = b"\0"
OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


class Request:
    """A decoded launch request: the shim's arguments and the directory the workload runs in."""

    def __init__(self, args: shim.Args, cwd: str) -> None:
        self.args = args
        self.cwd = cwd

    def __repr__(self) -> str:
        return f"Request(workdir={self.args.workdir!r}, cwd={self.cwd!r}, cmd={self.args.cmd!r})"


def make_request(
    *, workdir: str, cwd: str, cmd: list[str], env: dict[str, str], cgroups: list[str], rlimit_as: int | None
) -> Request:
    args = shim.Args()
    args.workdir, args.cmd, args.env, args.cgroups, args.rlimit_as = workdir, list(cmd), dict(env), cgroups, rlimit_as
    return Request(args, cwd)


# ---------------------------------------------------------------------------------------------------
# wire format (used by both sides)


def encode_request(request: Request) -> bytes:
    args = request.args
    rlimit = "" if args.rlimit_as is None else str(args.rlimit_as)
    fields = [args.workdir, request.cwd, rlimit, str(len(args.cgroups)), *args.cgroups, str(len(args.env))]
    fields += [f"{key}={value}" for key, value in args.env.items()]
    encoded = [os.fsencode(field) for field in (*fields, *args.cmd)]
    if any(FIELD_SEP in field for field in encoded):
        raise ValueError("embedded null byte")  # what exec (and Popen) would say
    return FIELD_SEP.join(encoded)


def decode_request(data: bytes) -> Request:
    """Raises ValueError (or IndexError) on a malformed request."""
    fields = [os.fsdecode(field) for field in data.split(FIELD_SEP)]
    args = shim.Args()
    args.workdir, cwd, rlimit = fields[0], fields[1], fields[2]
    args.rlimit_as = int(rlimit) if rlimit else None
    n_cgroups = int(fields[3])
    args.cgroups = fields[4 : 4 + n_cgroups]
    at = 4 + n_cgroups
    n_env = int(fields[at])
    for item in fields[at + 1 : at + 1 + n_env]:
        key, _, value = item.partition("=")
        args.env[key] = value
    args.cmd = fields[at + 1 + n_env :]
    if not args.workdir or not args.cmd or len(args.cgroups) != n_cgroups:
        raise ValueError("malformed launch request")
    return Request(args, cwd)


def encode_ok(pid: int, start_ticks: int) -> bytes:
    return f"ok {pid} {start_ticks}".encode()


def encode_error(code: int, message: str, filename: object = None) -> bytes:
    name = b"" if filename is None else os.fsencode(str(filename))
    return f"err {code} {message}".encode("utf-8", "replace") + FIELD_SEP + name


def decode_reply(data: bytes) -> tuple[int, int]:
    """(pid, start_ticks) of the shim; raises OSError (of the errno's subclass) for an error reply and
    ValueError for anything malformed."""
    head, _, filename = data.partition(FIELD_SEP)
    kind, _, rest = head.decode("utf-8", "replace").partition(" ")
    if kind == "ok":
        pid, ticks = rest.split()
        return int(pid), int(ticks)
    if kind == "err":
        code, _, message = rest.partition(" ")
        if filename:
            raise OSError(int(code), message, os.fsdecode(filename))
        raise OSError(int(code), message)
    raise ValueError(f"malformed launcher reply {data[:80]!r}")


def proc_stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3 onwards of /proc/<pid>/stat (so index 0 is the state), None if there is no such process.

    The comm field (2) may contain spaces and parentheses, so fields are counted after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()


# ---------------------------------------------------------------------------------------------------
# the server


def main(argv: list[str]) -> int:
    """`python -I -S -c BOOTSTRAP REPO_ROOT SOCKET_FD`: serve until the worker closes its end."""
    sock = int(argv[0])
    # What exists now never changes: keep the collector off it, so neither the launcher nor its
    # children write to (and so copy) the pages they share after each fork.
    gc.freeze()
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _on_sigchld)
    shims: dict[int, str] = {}  # pid -> workdir, until reaped
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while _drain(wake_r):
                pass
            reap(shims)
        if sock in ready and not _serve_one(sock, shims):
            return 0


def _on_sigchld(signum: int, frame: object) -> None:
    """Nothing: the wakeup fd tells the main loop, which reaps between requests."""


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _serve_one(sock: int, shims: dict[int, str]) -> bool:
    """Read and answer one request; False once the worker is gone."""
    try:
        data = os.read(sock, MAX_REQUEST + 1)
    except ConnectionError:
        return False
    if not data:
        return False  # end of file: the worker closed its end, or died
    go_fd = -1
    try:
        request = decode_request(data)
        pid, go_fd = _fork_shim(request)
        shims[pid] = request.args.workdir
        fields = proc_stat_fields(pid)  # cannot be gone: only this loop reaps it
        reply = encode_ok(pid, int(fields[19]) if fields else 0)
    except OSError as exc:
        reply = encode_error(exc.errno or errno.EIO, exc.strerror or str(exc), exc.filename)
    except (ValueError, IndexError) as exc:
        reply = encode_error(errno.EINVAL, str(exc))
    try:
        os.write(sock, reply)
    except ConnectionError:
        return False  # the child (if any) reads end of file instead of GO and starts nothing
    finally:
        if go_fd >= 0:
            _say_go(go_fd)
    return True


def _say_go(go_fd: int) -> None:
    try:
        os.write(go_fd, GO)
    except OSError:
        pass  # the child is already gone: it ends like any shim, and is reaped
    finally:
        os.close(go_fd)


def _fork_shim(request: Request) -> tuple[int, int]:
    """Fork a shim for `request`; return its pid and the fd to write GO to."""
    workdir = request.args.workdir
    opened: list[int] = []
    try:
        for name in ("stdout.log", "stderr.log"):
            opened.append(os.open(os.path.join(workdir, name), OPEN_FLAGS, 0o666))
        opened.append(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
        opened.append(go_r)
        os.chdir(request.cwd)  # here, so a missing directory is an error reply; the child inherits it
        try:
            pid = os.fork()
            if pid == 0:
                _become_shim(request, opened, go_w)
        except BaseException:
            os.close(go_w)
            raise
        finally:
            os.chdir("/")
        return pid, go_w
    finally:
        for fd in opened:
            os.close(fd)


def _become_shim(request: Request, fds: list[int], go_w: int) -> None:
    """In the forked child: what `Popen(start_new_session=True, close_fds=True, ...)` and a fresh
    `python -I -S shim.py` would have done, then the shim itself. Never returns to the loop."""
    out, err, null, go_r = fds
    status = 1
    try:
        os.close(go_w)  # only the launcher may hold it, or a dead launcher's EOF would never come
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        if os.read(go_r, 1) != GO:
            os._exit(ABANDONED)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        status = shim.run(request.args)
    except BaseException as exc:  # anything at all: the child must not fall back into the loop
        try:  # noqa: SIM105 - contextlib (and typing) are not imported: every module is copied by each fork
            os.write(2, f"fauxmad shim: {type(exc).__name__}: {exc}\n".encode())
        except BaseException:
            pass
    os._exit(status)


def reap(shims: dict[int, str]) -> None:
    """Reap every ended child, after recording the end of a shim that left no exit.json behind."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if ended is None:
            return
        workdir = shims.pop(ended.si_pid, None)
        if workdir is not None:
            record_shim_end(workdir, ended)
        try:  # noqa: SIM105
            os.waitpid(ended.si_pid, 0)
        except ChildProcessError:
            pass


def record_shim_end(workdir: str, ended: os.waitid_result) -> None:
    """The shim ended: if it never started the workload (no child.pid) and so wrote no exit.json, its
    own wait status is the task's end, as the driver would record for a shim that was its child."""
    status_path = os.path.join(workdir, "exit.json")
    if os.path.exists(status_path) or os.path.exists(os.path.join(workdir, "child.pid")):
        return
    if ended.si_code == os.CLD_EXITED:
        exit_code, sig = ended.si_status, None
    else:
        exit_code, sig = None, ended.si_status
    try:
        shim.write_atomic(status_path, shim.exit_record(exit_code, sig, time.time()), durable=True)
    except OSError as exc:
        os.write(2, f"fauxmad launcher: cannot write {status_path}: {exc}\n".encode())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
