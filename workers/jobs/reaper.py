"""Kill a worker's job processes when the worker dies: one small watcher process, not an exec per job.

A `process` attempt must die with its worker: a redelivery of its job runs it again at once (see
`take.orphan_fence`), so the lost attempt must be over. Each used to run under `setpriv --pdeathsig KILL`,
which execs one more program per job: 1.1 ms of CPU and 1.1 ms before the job's own command runs, a fifth
of what a short job cost the whole machine. Now one watcher per worker does it for all of them: a tiny
`python -S` started with the jobs, in a session of its own and deaf to SIGINT, SIGTERM and SIGHUP. The
worker writes each job's pid on the watcher's stdin when it spawns it, and `-pid` once it has seen it end
(before reaping it, so the pid cannot have been reused). The pipe's write end is the worker's alone
(close-on-exec: no job inherits it), so the watcher reads EOF the moment the worker is gone, however it
died, and SIGKILLs the process group (each job's own session) of every pid still listed.

Left open: a worker killed between `posix_spawn` returning and the pid's write (microseconds) leaves that
one job running; so did `setpriv`, between its start and its `prctl`. If the watcher itself dies (someone
kills it), the next write starts another and hands it every pid still running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

WATCHER = """
import os, signal
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
live, rest = set(), b""
while True:
    try:
        chunk = os.read(0, 65536)
    except InterruptedError:
        continue
    if not chunk:
        break
    *lines, rest = (rest + chunk).split(b"\\n")
    for line in lines:
        if line[:1] == b"-":
            live.discard(line[1:])
        elif line:
            live.add(line)
for pid in live:
    try:
        os.killpg(int(pid), signal.SIGKILL)
    except OSError:
        pass
"""


class Reaper:
    """The worker's end: `watch(pid)` after a spawn, `forget(pid)` when it ended; see the module docstring."""

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.live: set[int] = set()
        self._proc: subprocess.Popen[bytes] | None = None

    def _watcher(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is None:
            proc = self._proc = subprocess.Popen(
                [self.python, "-S", "-c", WATCHER],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            if self.live:  # a new watcher: it must know every job still running
                self._send(proc, "".join(f"{pid}\n" for pid in self.live))
        return proc

    @staticmethod
    def _send(proc: subprocess.Popen[bytes], text: str) -> None:
        assert proc.stdin is not None
        os.write(proc.stdin.fileno(), text.encode())

    def _write(self, text: str) -> None:
        for _ in range(2):
            proc = self._watcher()
            try:
                self._send(proc, text)
                return
            except OSError:  # it is gone (EPIPE: nobody reads the pipe): the next round starts another
                log.warning("the job reaper (pid %d) is gone: starting another", proc.pid)
                self._proc = None
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    proc.wait(1.0)
        log.error("the job reaper cannot be started: job processes may outlive this worker")

    def watch(self, pid: int) -> None:
        self.live.add(pid)
        self._write(f"{pid}\n")

    def forget(self, pid: int) -> None:
        if pid in self.live:
            self.live.discard(pid)
            self._write(f"-{pid}\n")

    def close(self) -> None:
        """The worker stops on purpose: the watcher ends, killing whatever still runs (as if the worker died)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2.0)
