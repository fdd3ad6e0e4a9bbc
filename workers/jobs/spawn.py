"""Start a short-lived child cheaply from a big process: `posix_spawn`, a pidfd, and non-blocking pipes.

Why not `asyncio.create_subprocess_exec`: it forks, and a fork copies the page tables of the whole worker
(its LMDB map, its threads' stacks); on the job fast path that copy was a third of the worker's CPU. glibc's
`posix_spawn` uses `clone(CLONE_VM | CLONE_VFORK)`: no copy, whatever the parent's size. The child gets
its own session (`setsid`), stdin from /dev/null and two pipes for stdout and stderr, which the event loop
reads as they fill (keeping the tail); its end is seen on a pidfd (no SIGCHLD handler, no thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping

import msgspec

TAIL_BYTES = 64 * 1024  # per stream, kept while reading (the record keeps less)


class Ended(msgspec.Struct, kw_only=True):
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    how: str = "done"  # done, timeout, cancelled


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

    def close(self) -> None:
        if not self.done.done():
            self.loop.remove_reader(self.fd)
            os.close(self.fd)
            self.done.set_result(None)


async def spawn(argv: list[str], env: Mapping[str, str], timeout: float, cancel: asyncio.Event) -> Ended:
    """Run `argv` (found on `env`'s PATH) to its end, or kill its process group at `timeout` or `cancel`."""
    loop = asyncio.get_running_loop()
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
    pidfd = os.pidfd_open(pid)
    exited = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    tails = [_Tail(loop, out_r), _Tail(loop, err_r)]
    cancelled = asyncio.ensure_future(cancel.wait())
    how = "done"
    try:
        done, _ = await asyncio.wait({exited, cancelled}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if exited not in done:
            how = "cancelled" if cancel.is_set() else "timeout"
            _kill(pid)
            await exited
        # the pipes end when every process holding them does; a grandchild may keep one open: do not wait for it
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(t.done for t in tails)), 1.0)
    except BaseException:  # cancelled (the worker stops): the child goes too, and is reaped below
        _kill(pid)
        raise
    finally:
        cancelled.cancel()
        loop.remove_reader(pidfd)
        for tail in tails:
            tail.close()
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


def _kill(pid: int) -> None:
    """SIGKILL the child's process group (its session: `setsid`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
