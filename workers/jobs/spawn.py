"""Start a short-lived child cheaply from a big process: `posix_spawn`, a pidfd, and non-blocking pipes.

Why not `asyncio.create_subprocess_exec`: it forks, and a fork copies the page tables of the whole worker
(its LMDB map, its threads' stacks); on the job fast path that copy was a third of the worker's CPU. glibc's
`posix_spawn` uses `clone(CLONE_VM | CLONE_VFORK)`: no copy, whatever the parent's size. The child gets
its own session (`setsid`), stdin from /dev/null and two pipes for stdout and stderr, which the event loop
reads as they fill (keeping the tail); its end is seen on a pidfd (no SIGCHLD handler, no thread).

A short job is over in a few milliseconds, so what waits for it is kept to one future settled by callbacks
(the pidfd, one timer, the cancel), not tasks: each task, `asyncio.wait` or `wait_for` cost about as much
CPU as the NATS write of the job's outcome. At its end the pipes are drained at once (the child is gone,
so they are at EOF), unless a grandchild still holds one.

`posix_spawn` is called on the event loop, not on a thread: CPython's `os.posix_spawnp` keeps the GIL while the
parent waits for the child's exec (3.11: a child held before its exec held every thread of the worker), so
on a thread the loop does not go on meanwhile, and the job pays a hop to the thread and one back to the loop
before its process is known to run (issue 43: docs/benchmarks.md, 2026-11-29).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Mapping

import msgspec

from workers.jobs.reaper import Reaper

TAIL_BYTES = 64 * 1024  # per stream, kept while reading (the record keeps less)
GRANDCHILD_GRACE = 1.0  # seconds an ended job's pipes may stay open (a grandchild holds one) before we stop reading


class Ended(msgspec.Struct, kw_only=True):
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    how: str = "done"  # done, timeout, cancelled


class Cancel(asyncio.Event):
    """An `asyncio.Event` that also calls back when set, so a wait on it needs no task of its own."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once set (now, if it is); returns how to take the callback back."""
        if self.is_set():
            callback()
            return lambda: None
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def set(self) -> None:
        super().set()
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class _Tail:
    """A pipe's last `TAIL_BYTES`, read whenever the loop says it is readable; `done` at EOF."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self.loop, self.fd = loop, fd
        self.data = bytearray()
        self.done = loop.create_future()
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            self.data += chunk
            if len(self.data) > 2 * TAIL_BYTES:
                del self.data[:-TAIL_BYTES]
            return
        self.close()

    def drain(self) -> bool:
        """Read what is there now; True once at EOF (closed)."""
        while not self.done.done():
            before = len(self.data)
            self._read()
            if not self.done.done() and len(self.data) == before:
                return False  # nothing more for now: someone still holds the pipe open
        return True

    def close(self) -> None:
        if not self.done.done():
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.done.set_result(None)


async def spawn(
    argv: list[str],
    env: Mapping[str, str],
    timeout: float,
    cancel: Cancel,
    reaper: Reaper | None = None,
    started: Callable[[], None] | None = None,
) -> Ended:
    """Run `argv` (found on `env`'s PATH) to its end, or kill its process group at `timeout` or `cancel`;
    `reaper` kills it if this process dies first (see `workers.jobs.reaper`); `started` is called once it
    runs (`posix_spawn` returns after the child's exec)."""
    loop = asyncio.get_running_loop()
    pid, out_r, err_r = _start(argv, env)
    if reaper is not None:
        reaper.watch(pid)
    if started is not None:
        started()
    pidfd = os.pidfd_open(pid)
    ending: asyncio.Future[str] = loop.create_future()

    def end(how: str) -> None:
        if not ending.done():
            ending.set_result(how)

    loop.add_reader(pidfd, end, "done")
    timer = loop.call_later(timeout, end, "timeout")
    forget_cancel = cancel.on_set(lambda: end("cancelled"))
    tails = [_Tail(loop, out_r), _Tail(loop, err_r)]
    how = "done"
    try:
        how = await ending
        loop.remove_reader(pidfd)  # it stays readable: left registered, it would call back on every turn
        if how != "done":
            _kill(pid)
            await _exited(loop, pidfd)
        # the pipes end when every process holding them does; a grandchild may keep one open: do not wait for it
        if not all([tail.drain() for tail in tails]):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GRANDCHILD_GRACE):
                    await asyncio.gather(*(tail.done for tail in tails))
    except BaseException:  # cancelled (the worker stops): the child goes too, and is reaped below
        _kill(pid)
        raise
    finally:
        timer.cancel()
        forget_cancel()
        loop.remove_reader(pidfd)
        for tail in tails:
            tail.close()
        if reaper is not None:  # before the reaping: until then the pid cannot name another process
            reaper.forget(pid)
        _, status = os.waitpid(pid, 0)
        os.close(pidfd)
    code = os.waitstatus_to_exitcode(status)
    return Ended(
        exit_code=code if code >= 0 else None,
        signal=-code if code < 0 else None,
        stdout=bytes(tails[0].data),
        stderr=bytes(tails[1].data),
        how=how,
    )


def _start(argv: list[str], env: Mapping[str, str]) -> tuple[int, int, int]:
    """(the child's pid, the read ends of its stdout and stderr)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            dict(env),
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setsid=True,
        )
    except OSError:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, devnull):
            os.close(fd)
    return pid, out_r, err_r


async def _exited(loop: asyncio.AbstractEventLoop, pidfd: int) -> None:
    """Until the process behind `pidfd` (just sent SIGKILL) has ended."""
    gone: asyncio.Future[None] = loop.create_future()

    def seen() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(pidfd, seen)
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)


def _kill(pid: int) -> None:
    """SIGKILL the child's process group (its session: `setsid`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
