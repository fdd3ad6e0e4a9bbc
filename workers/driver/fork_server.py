"""The launcher: a fork server that starts shims for one worker without starting an interpreter each time.

Why it exists: `python -I -S shim.py` costs ~20-30 ms of CPU per machine start, nearly all of it
interpreter start-up, and on a small host that competes with the next create. The launcher is one
long-lived `python -I -S` per `ProcessDriver` that already holds the shim's code. It keeps `SPARES`
children forked ahead of need; a request hands its job to one of them, which becomes the shim
exactly as a fresh one would (new session, the machine's log files as stdout/stderr, /dev/null as
stdin, no other fds, the machine's cwd, then `shim.run`). A start then costs one message to a
process that already exists, and the fork of its replacement happens after the reply, off the path.

Key decisions:

- STDLIB ONLY besides `workers.driver.shim` (itself stdlib only), run as `python -I -S`: like the shim, it
  must not depend on the worker's virtualenv or environment. Its own start-up (~30 ms) is paid once.
  Few imports (no typing, no contextlib) and a frozen heap: a fork copies the page tables of all
  that is mapped, and every page either side writes to afterwards, and on a VM that is the cost.
- Spares: each is forked with a SOCK_SEQPACKET channel of its own, calls setsid, takes /dev/null as
  stdin and stdout and closes every other fd of the launcher's (the worker's socket, the other
  spares' channels) at once, then waits. A job arrives as the request itself plus the stdout, stderr
  and cwd descriptors (SCM_RIGHTS). A spare that dies while waiting is reaped and replaced; the
  launcher forks replacements only when no request is waiting, after `REFILL_DELAY` while a spare
  is still left (a fork right after a reply would compete with the worker reading it), at once when
  none is. With no spare (a burst, or a failed fork), the launcher forks the shim on the request's
  path, as it always did; a job too big for one message does the same.
- The launcher runs as SCHED_BATCH, which never preempts on wake-up: a request otherwise made the
  kernel run the launcher at once on the worker's CPU, in the middle of the worker's `send` (a
  millisecond of the worker's event loop per start on a busy 2-core VM). Its children switch back
  to SCHED_OTHER first thing, so machines are scheduled like any other process.
- Machines outlive the launcher: each shim is in a session of its own, and nothing of the launcher
  is left open in it. The launcher exits when its request socket reaches end of file, which the
  kernel delivers the moment the worker dies, however it dies; its waiting spares then read end of
  file on their channels and exit too (reaped by the launcher when it exits on its own). (No
  PR_SET_PDEATHSIG: it fires when the *thread* that spawned the launcher ends, which would kill a
  healthy launcher started from a thread pool.)
- The reply names a spare (pid, `start_ticks` read when it was forked: until the launcher reaps it
  the pid cannot be reused) and is sent as soon as the job is handed over, so the driver's `start`
  returns before the shim has even run: its redirections come a moment later, always before it
  forks the workload (so `child.pid` names a process in the shim's session, which the driver checks).
- Fallible set-up happens in the launcher before the hand-over (decoding, creating the workdir and
  clearing what a previous run left in it, opening the logs and the cwd), so a bad request gets an
  error reply, as `subprocess.Popen` would raise, not a dead shim; and none of that filesystem work
  runs on the worker's event loop.
- No duplicate machines: the child waits for one byte (`GO`: on its channel for a spare, on a pipe
  for a child forked on the path) that the launcher writes only after its reply is sent. If the
  launcher dies in between, the child reads end of file and exits (`ABANDONED`) without starting
  anything, so a worker that got no reply can safely fall back to starting the shim itself.
- The launcher reaps its shims and spares (SIGCHLD through a wakeup fd, handled in the main loop, so
  reaping never interleaves with a launch), and every ended one before it reads a request: a machine's next
  run must find the end of the run before recorded, not have it recorded into its own directory. The
  worker cannot `waitid` them, so a shim that ended without writing `exit.json` and never started its
  workload gets one from the launcher, holding the shim's own wait status, written *before* the zombie
  is reaped: the driver waits for that reaping before it decides, and `exit.json` stays the single
  source of truth. A shim that died under a running workload is left to the driver, which kills that
  workload and reports it lost.

Wire format (one SOCK_SEQPACKET message each way, fields NUL-separated; exec arguments cannot hold NUL):
request `workdir, cwd, rlimit_as or "", sandbox ("bwrap" or ""), N, N cgroups, M, M "KEY=VALUE", cmd...`;
reply `ok PID START_TICKS` or `err ERRNO MESSAGE` + NUL + the file it is about (may be empty).
A job, launcher to spare: the request's bytes with three descriptors (stdout, stderr, cwd), then `GO`.
"""

from __future__ import annotations

import errno
import gc
import os
import select
import signal
import socket
import sys
import time

from workers.driver import shim

MAX_REQUEST = 256 * 1024  # bigger requests (a huge environment) are started the direct way
GO = b"g"
ABANDONED = 125  # a child whose launcher died before saying GO: it started nothing
FIELD_SEP = b"\0"
OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
STALE = ("exit.json", "child.pid")  # what a run leaves in its workdir
TEMPORARY = ("exit.json.tmp.", "child.pid.tmp.")  # + the writer's pid (shim.write_atomic)
CWD_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
SPARES = 2  # children forked ahead: one for the next request, one for a burst
# A spare is forked once no request has come for this long (at once when none is left): a fork
# right after a reply competes for the CPU with the worker that is reading that reply.
REFILL_DELAY = 0.005


class Request:
    """A decoded launch request: the shim's arguments and the directory the workload runs in."""

    def __init__(self, args: shim.Args, cwd: str) -> None:
        self.args = args
        self.cwd = cwd

    def __repr__(self) -> str:
        return f"Request(workdir={self.args.workdir!r}, cwd={self.cwd!r}, cmd={self.args.cmd!r})"


def make_request(
    *,
    workdir: str,
    cwd: str,
    cmd: list[str],
    env: dict[str, str],
    cgroups: list[str],
    rlimit_as: int | None,
    sandbox: bool = False,
    user: str = "",
) -> Request:
    args = shim.Args()
    args.workdir, args.cmd, args.env, args.cgroups, args.rlimit_as = workdir, list(cmd), dict(env), cgroups, rlimit_as
    args.sandbox, args.user = sandbox, user
    return Request(args, cwd)


# ---------------------------------------------------------------------------------------------------
# wire format (used by both sides)


def encode_request(request: Request) -> bytes:
    args = request.args
    rlimit = "" if args.rlimit_as is None else str(args.rlimit_as)
    sandbox = "bwrap" if args.sandbox else ""
    fields = [args.workdir, request.cwd, rlimit, sandbox, args.user, str(len(args.cgroups)), *args.cgroups]
    fields.append(str(len(args.env)))
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
    args.sandbox = fields[3] == "bwrap"
    args.user = fields[4]
    n_cgroups = int(fields[5])
    args.cgroups = fields[6 : 6 + n_cgroups]
    at = 6 + n_cgroups
    n_env = int(fields[at])
    for item in fields[at + 1 : at + 1 + n_env]:
        key, _, value = item.partition("=")
        args.env[key] = value
    args.cmd = fields[at + 1 + n_env :]
    uid, colon, gid = args.user.partition(":")
    if args.user and not (colon and uid.isdigit() and gid.isdigit()):
        raise ValueError("malformed launch request: user must be UID:GID")
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


class Spare:
    """A child forked ahead of need, waiting on `chan` for a job; `ticks` is its start time."""

    def __init__(self, pid: int, ticks: int, chan: socket.socket) -> None:
        self.pid = pid
        self.ticks = ticks
        self.chan = chan

    def __repr__(self) -> str:
        return f"Spare(pid={self.pid})"


def main(argv: list[str]) -> int:
    """`python -I -S -c BOOTSTRAP REPO_ROOT SOCKET_FD [SPARES]`: serve until the worker closes its end."""
    sock = int(argv[0])
    wanted = int(argv[1]) if len(argv) > 1 else SPARES
    # What exists now never changes: keep the collector off it, so neither the launcher nor its
    # children write to (and so copy) the pages they share after each fork.
    gc.freeze()
    _set_policy(os.SCHED_BATCH)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _on_sigchld)
    shims: dict[int, str] = {}  # pid -> workdir, until reaped
    spares: dict[int, Spare] = {}  # pid -> spare, until handed a job or reaped
    refill = True  # False after a failed fork, until the next request
    try:
        while True:
            # Requests first: a missing spare is forked only when no request is waiting.
            idle = None if not refill or len(spares) >= wanted else REFILL_DELAY if spares else 0.0
            ready, _, _ = select.select([sock, wake_r], [], [], idle)
            if not ready:
                refill = _add_spare(spares)
                continue
            if wake_r in ready:
                while _drain(wake_r):
                    pass
                reap(shims, spares)
            if sock in ready:
                if not _serve_one(sock, shims, spares):
                    return 0
                refill = True
    finally:
        _dismiss(spares)


def _set_policy(policy: int) -> None:
    try:  # noqa: SIM105
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass  # (a seccomp filter, say) only latency is at stake


def _on_sigchld(signum: int, frame: object) -> None:
    """Nothing: the wakeup fd tells the main loop, which reaps between requests."""


def _drain(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def _serve_one(sock: int, shims: dict[int, str], spares: dict[int, Spare]) -> bool:
    """Read and answer one request; False once the worker is gone."""
    try:
        data = os.read(sock, MAX_REQUEST + 1)
    except ConnectionError:
        return False
    if not data:
        return False  # end of file: the worker closed its end, or died
    go_fd = -1
    # Every shim that has ended is reaped (its end recorded) before this request clears its workdir: the worker
    # asks for a machine's next run only once it saw the run before end, and that shim's record, written late,
    # would land in the new run's directory (as its end). The wakeup fd alone does not order the two: the
    # request can be read first.
    reap(shims, spares)
    try:
        request = decode_request(data)
        fds = _open_job_files(request)
        try:
            pid, ticks, go_fd = _hand_to_spare(spares, data, fds) or _fork_shim(request, fds)
        finally:
            for fd in fds:
                os.close(fd)
        shims[pid] = request.args.workdir
        reply = encode_ok(pid, ticks)
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


def prepare_workdir(workdir: str) -> None:
    """The machine's own directory, without the files a previous run of it left (a restart reuses
    it): done here rather than in the worker, whose event loop a slow filesystem would stall."""
    try:
        os.mkdir(workdir)
        return  # new: nothing stale in it
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(workdir, exist_ok=True)
        return
    for name in STALE:
        try:  # noqa: SIM105
            os.unlink(os.path.join(workdir, name))
        except FileNotFoundError:
            pass
    for name in os.listdir(workdir):  # a temporary file only once its writer is gone: a live one renames it
        if name.startswith(TEMPORARY) and not _alive(name.rpartition(".")[2]):
            try:  # noqa: SIM105
                os.unlink(os.path.join(workdir, name))
            except FileNotFoundError:
                pass


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        pass
    return True


def _open_job_files(request: Request) -> list[int]:
    """The shim's stdout, stderr and cwd (an O_PATH descriptor), opened here so that a missing
    directory or an unwritable log is an error reply, as `Popen` would raise, not a dead shim."""
    prepare_workdir(request.args.workdir)
    opened: list[int] = []
    try:
        for name in ("stdout.log", "stderr.log"):
            opened.append(os.open(os.path.join(request.args.workdir, name), OPEN_FLAGS, 0o666))
        opened.append(os.open(request.cwd, CWD_FLAGS))
    except BaseException:
        for fd in opened:
            os.close(fd)
        raise
    return opened


def _hand_to_spare(spares: dict[int, Spare], data: bytes, fds: list[int]) -> tuple[int, int, int] | None:
    """Send the job to a waiting spare: its pid, start time and the fd to write GO to; None when no
    spare took it (none left, or the job is too big for one message)."""
    while spares:
        pid = next(iter(spares))
        spare = spares.pop(pid)
        try:
            socket.send_fds(spare.chan, [data], fds)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                spares[pid] = spare  # still good for the next job
                return None
            spare.chan.close()  # it died before its job: reaped by the loop, not a shim
            continue
        return spare.pid, spare.ticks, spare.chan.detach()
    return None


def _add_spare(spares: dict[int, Spare]) -> bool:
    """Fork one spare; False if that failed (the loop retries after the next request)."""
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return False
    try:
        pid = os.fork()
        if pid == 0:
            _wait_for_job(theirs)
    except OSError:
        ours.close()
        return False
    finally:
        theirs.close()
    fields = proc_stat_fields(pid)  # cannot be gone: only this loop reaps it
    spares[pid] = Spare(pid, int(fields[19]) if fields else 0, ours)
    return True


def _dismiss(spares: dict[int, Spare]) -> None:
    """The launcher is ending: its spares read end of file and exit; reap them (at once)."""
    for spare in spares.values():
        spare.chan.close()
    for pid in spares:
        try:  # noqa: SIM105
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _fork_shim(request: Request, fds: list[int]) -> tuple[int, int, int]:
    """No spare: fork a shim for `request` now; return its pid, start time and the fd to write GO to."""
    go_r, go_w = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                _leave_launcher(keep=(go_r, *fds))
                status = _run_job(request, fds, go_r)
            except BaseException as exc:  # the child must not fall back into the loop
                _complain(exc)
            os._exit(status)
    except BaseException:
        os.close(go_w)
        raise
    finally:
        os.close(go_r)
    fields = proc_stat_fields(pid)  # cannot be gone: only this loop reaps it
    return pid, int(fields[19]) if fields else 0, go_w


def _wait_for_job(chan: socket.socket) -> None:
    """In a spare: leave the launcher behind, wait for a job, become its shim. Never returns."""
    status = 1
    try:
        _leave_launcher(keep=(chan.fileno(),))
        data, fds, _, _ = socket.recv_fds(chan, MAX_REQUEST + 1, 3)
        if not data or len(fds) != 3:
            os._exit(ABANDONED)  # the launcher ended first
        status = _run_job(decode_request(data), fds, chan.fileno())
    except BaseException as exc:
        _complain(exc)
    os._exit(status)


def _leave_launcher(keep: tuple[int, ...]) -> None:
    """In a new child: drop the launcher's signal set-up and every fd but `keep` and stderr (so no
    child holds the worker's socket or a sibling's GO channel), start a session, stdin from /dev/null."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _set_policy(os.SCHED_OTHER)  # the machine's processes are scheduled like any other
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _run_job(request: Request, fds: list[int], go_fd: int) -> int:
    """What `Popen(start_new_session=True, close_fds=True, ...)` and a fresh `python -I -S shim.py`
    would have done (stdio, cwd, no other fds), once the launcher says GO; then the shim itself."""
    out, err, cwd = fds
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.fchdir(cwd)
        for fd in fds:
            os.close(fd)
        if os.read(go_fd, 1) != GO:
            return ABANDONED
        os.close(go_fd)
        return shim.run(request.args)
    except BaseException as exc:  # anything at all: the child must not fall back into the loop
        _complain(exc)
        return 1


def _complain(exc: BaseException) -> None:
    try:  # noqa: SIM105 - contextlib (and typing) are not imported: every module is copied by each fork
        os.write(2, f"fauxmad shim: {type(exc).__name__}: {exc}\n".encode())
    except BaseException:
        pass


def reap(shims: dict[int, str], spares: dict[int, Spare] | None = None) -> None:
    """Reap every ended child, after recording the end of a shim that left no exit.json behind; a
    spare that ended before its job is forgotten (the loop forks another)."""
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
        spare = spares.pop(ended.si_pid, None) if spares is not None else None
        if spare is not None:
            spare.chan.close()
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
