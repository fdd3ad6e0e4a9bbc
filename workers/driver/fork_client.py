"""The worker's end of the launcher (workers/driver/fork_server.py): spawn it, ask it for shims, replace it.

Why it exists: `ProcessDriver.start` wants a shim in well under a millisecond without blocking the
worker's event loop, and must still start one when there is no launcher. This module owns the
helper process and its socket so the driver only sees `await launch(request) -> (pid, start_ticks)`,
or None meaning "start it the direct way".

Key decisions:

- Spawned lazily by the first launch, so a driver that only recovers, inspects or waits (a restarted
  worker's bookkeeping, the tests' cleanup) never starts one.
- One request at a time per event loop (an `asyncio.Lock`), awaited on the non-blocking socket
  (`loop.sock_sendall` / `sock_recv`): the event loop serves other requests while the launcher
  answers. A second loop in another thread that finds a round trip in flight starts its shim the
  direct way rather than wait (a `threading.Lock`, tried without blocking, guards the socket).
- A launch cancelled while its request is out (the worker stopping, a caller's timeout) may have
  started a shim that nobody will hear of: the launcher is killed at once (a child it had not yet
  told GO starts nothing), and a reply it had already sent is handed to `orphaned`, which ends
  that machine. The next launch spawns a new launcher.
- Any failure of the launcher itself (cannot spawn, died, closed, silent past `LAUNCH_TIMEOUT`) is
  logged once, the launcher is discarded and this start goes the direct way; the next start spawns a
  new one. After `MAX_FAILURES` failures in a row the driver stops trying for its lifetime.
- A start is never duplicated: a launcher that dies before saying GO to its child leaves a child that
  starts nothing (see workers/driver/fork_server.py). On a timeout the launcher is killed first, then a reply
  that arrived meanwhile is still used.
- An error *reply* (a missing cwd, an unopenable log) is not a launcher failure: it is raised as the
  OSError that `Popen` would have raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from workers.driver.fork_server import MAX_REQUEST, SPARES, Request, decode_reply, encode_request

log = logging.getLogger(__name__)

REPO_ROOT = str(Path(__file__).resolve().parents[2])
BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from workers.driver.fork_server import main; sys.exit(main(sys.argv[2:]))"
)
LAUNCH_TIMEOUT = 10.0  # generous: the first request also waits for the launcher's own start-up
CLOSE_TIMEOUT = 2.0
MAX_FAILURES = 3
REPLY_SIZE = 4096


class LauncherFailed(Exception):
    """The launcher could not serve a request (not an error reply): start the shim directly, unless
    `late_reply` holds the answer it managed to send before it was killed."""

    def __init__(self, why: str, late_reply: bytes = b"") -> None:
        super().__init__(why)
        self.late_reply = late_reply


Orphaned = Callable[[Request, int, int], None]


class LauncherClient:
    """One launcher process and the socket to it; see the module docstring."""

    def __init__(self, python: str, orphaned: Orphaned | None = None, spares: int = SPARES) -> None:
        self.python = python
        self.spares = spares
        self._orphaned = orphaned
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._turn: asyncio.Lock | None = None
        self._turn_loop: asyncio.AbstractEventLoop | None = None
        self._busy = threading.Lock()
        self._failures = 0
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pid={self.pid}"
        return f"LauncherClient({state}, failures={self._failures})"

    @property
    def pid(self) -> int | None:
        """The running launcher's pid (the parent of the shims it started), None if there is none."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    async def launch(self, request: Request) -> tuple[int, int] | None:
        """(pid, start_ticks) of a new shim, or None: no launcher, start the shim directly."""
        data = encode_request(request)
        if len(data) > MAX_REQUEST:
            return None
        async with self._my_turn():
            if self._closed or self._failures >= MAX_FAILURES or not self._busy.acquire(blocking=False):
                return None  # (busy: another thread's loop is in a round trip right now)
            try:
                reply = await self._exchange(request, data)
            finally:
                self._busy.release()
        return decode_reply(reply) if reply else None

    def close(self) -> None:
        """Stop the launcher (it exits on end of file); the shims it started keep running."""
        # Bounded: called from the loop's own thread, it must not wait forever for a round trip in
        # flight on that loop (it then ends at its timeout, on a closed socket).
        acquired = self._busy.acquire(timeout=CLOSE_TIMEOUT)
        try:
            self._closed = True
            self._discard(kill=False)
        finally:
            if acquired:
                self._busy.release()

    # -- internals -----------------------------------------------------------------------------------

    def _my_turn(self) -> asyncio.Lock:
        """One round trip at a time per event loop; a new loop (each `asyncio.run`) gets a new lock."""
        loop = asyncio.get_running_loop()
        if self._turn is None or self._turn_loop is not loop:
            self._turn, self._turn_loop = asyncio.Lock(), loop
        return self._turn

    async def _exchange(self, request: Request, data: bytes) -> bytes:
        """The launcher's reply, or b"" when it failed (and was discarded) or the request could not
        be sent as one message (too big for the socket's buffer: kept, this start goes direct)."""
        try:
            sock = self._sock or self._spawn()
            reply = await self._round_trip(sock, request, data)
        except LauncherFailed as exc:
            self._failed(str(exc))
            return exc.late_reply
        self._failures = 0
        return reply

    def _spawn(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [self.python, "-I", "-S", "-c", BOOTSTRAP, REPO_ROOT, str(theirs.fileno()), str(self.spares)],
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # no terminal's Ctrl-C; the shims it forks get sessions of their own
            )
        except OSError as exc:
            ours.close()
            raise LauncherFailed(f"cannot start the launcher: {exc}") from exc
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        return ours

    async def _round_trip(self, sock: socket.socket, request: Request, data: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(sock, data)  # one SEQPACKET message: sent whole or not at all
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:  # bigger than the socket's buffer: nothing was sent
                return b""
            raise LauncherFailed(f"the launcher is gone ({exc})") from exc
        try:
            async with asyncio.timeout(LAUNCH_TIMEOUT):
                reply = await loop.sock_recv(sock, REPLY_SIZE)
        except TimeoutError:
            raise LauncherFailed(
                f"the launcher did not answer in {LAUNCH_TIMEOUT} s", self._reply_after_kill(sock)
            ) from None
        except asyncio.CancelledError:
            self._abandon(sock, request)
            raise
        except OSError as exc:
            raise LauncherFailed(f"the launcher is gone ({exc})") from exc
        if not reply:
            raise LauncherFailed("the launcher is gone (end of file)")
        return reply

    def _abandon(self, sock: socket.socket, request: Request) -> None:
        """Cancelled mid-request: the launcher may be starting a shim nobody will hear of. Kill it (a
        child not yet told GO starts nothing), and hand a shim it had already answered with to
        `orphaned`, so that it is ended. The next launch spawns a new launcher."""
        late = self._reply_after_kill(sock)
        self._discard(kill=True)
        log.info("a launch was cancelled mid-request: launcher discarded")
        with contextlib.suppress(OSError, ValueError):
            if late and self._orphaned is not None:
                self._orphaned(request, *decode_reply(late))

    def _reply_after_kill(self, sock: socket.socket) -> bytes:
        """Silent too long: kill it (its child, if any, then starts nothing), and use a reply that
        made it into the socket before it died, if one did."""
        self._kill()
        try:
            return sock.recv(REPLY_SIZE)
        except OSError:
            return b""

    def _failed(self, why: str) -> None:
        self._failures += 1
        self._discard(kill=True)
        if self._failures >= MAX_FAILURES:
            log.warning("%s; %d failures in a row: starting shims directly from now on", why, self._failures)
        else:
            log.warning("%s; starting this shim directly, the next start spawns a new launcher", why)

    def _kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()

    def _discard(self, kill: bool) -> None:
        if self._sock is not None:
            self._sock.close()  # end of file: a live launcher exits on its own
            self._sock = None
        if self._proc is not None:
            if kill:
                self._kill()
            else:
                try:
                    self._proc.wait(CLOSE_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._proc = None
