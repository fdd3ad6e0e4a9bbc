"""The worker's end of the launcher (workers/launcher.py): spawn it, ask it for shims, replace it.

Why it exists: `ProcessDriver.start` wants a shim in well under a millisecond, and must still start
one when there is no launcher. This module owns the helper process and its socket so the driver only
sees `launch(request) -> (pid, start_ticks)`, or None meaning "start it the direct way".

Key decisions:

- Spawned lazily by the first launch, so a driver that only recovers, inspects or waits (a restarted
  worker's bookkeeping, the tests' cleanup) never starts one.
- One request at a time, answered synchronously: the launcher's fork takes a fraction of a
  millisecond, less than `subprocess.Popen` blocked the event loop for before, and a blocking round
  trip is independent of whichever event loop (or thread) calls it.
- Any failure of the launcher itself (cannot spawn, died, closed, silent past `LAUNCH_TIMEOUT`) is
  logged once, the launcher is discarded and this start goes the direct way; the next start spawns a
  new one. After `MAX_FAILURES` failures in a row the driver stops trying for its lifetime.
- A start is never duplicated: a launcher that dies before saying GO to its child leaves a child that
  starts nothing (see workers/launcher.py). On a timeout the launcher is killed first, then a reply
  that arrived meanwhile is still used.
- An error *reply* (a missing cwd, an unopenable log) is not a launcher failure: it is raised as the
  OSError that `Popen` would have raised.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import threading
from pathlib import Path

from workers.launcher import MAX_REQUEST, Request, decode_reply, encode_request

log = logging.getLogger(__name__)

REPO_ROOT = str(Path(__file__).resolve().parents[1])
BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); from workers.launcher import main; sys.exit(main(sys.argv[2:]))"
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


class LauncherClient:
    """One launcher process and the socket to it; see the module docstring."""

    def __init__(self, python: str) -> None:
        self.python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
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

    def launch(self, request: Request) -> tuple[int, int] | None:
        """(pid, start_ticks) of a new shim, or None: no launcher, start the shim directly."""
        data = encode_request(request)
        if len(data) > MAX_REQUEST:
            return None
        with self._lock:
            if self._closed or self._failures >= MAX_FAILURES:
                return None
            try:
                sock = self._sock or self._spawn()
                reply = self._round_trip(sock, data)
            except LauncherFailed as exc:
                self._failed(str(exc))
                if not exc.late_reply:
                    return None
                reply = exc.late_reply
            else:
                self._failures = 0
        return decode_reply(reply)

    def close(self) -> None:
        """Stop the launcher (it exits on end of file); the shims it started keep running."""
        with self._lock:
            self._closed = True
            self._discard(kill=False)

    # -- internals -----------------------------------------------------------------------------------

    def _spawn(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [self.python, "-I", "-S", "-c", BOOTSTRAP, REPO_ROOT, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # no terminal's Ctrl-C; the shims it forks get sessions of their own
            )
        except OSError as exc:
            ours.close()
            raise LauncherFailed(f"cannot start the launcher: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(LAUNCH_TIMEOUT)
        self._sock = ours
        return ours

    def _round_trip(self, sock: socket.socket, data: bytes) -> bytes:
        try:
            sock.send(data)
            reply = sock.recv(REPLY_SIZE)
        except TimeoutError:
            raise LauncherFailed(
                f"the launcher did not answer in {LAUNCH_TIMEOUT} s", self._reply_after_kill(sock)
            ) from None
        except OSError as exc:
            raise LauncherFailed(f"the launcher is gone ({exc})") from exc
        if not reply:
            raise LauncherFailed("the launcher is gone (end of file)")
        return reply

    def _reply_after_kill(self, sock: socket.socket) -> bytes:
        """Silent too long: kill it (its child, if any, then starts nothing), and use a reply that
        made it into the socket before it died, if one did."""
        self._kill()
        sock.setblocking(False)
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
