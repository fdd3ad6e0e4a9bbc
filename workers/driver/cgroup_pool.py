"""Cgroups made ahead of need, so that a machine's start only renames one (and usually writes nothing).

Why it exists: creating a cgroup is the slow part of `Limits.prepare` (the kernel sets up every
controller's state: ~0.6 ms per directory on a busy VM, two directories on cgroup v1), and it sat on
the start path of every machine. A small pool per worker, refilled by a background thread, moves
that work off the path: `claim` pops a pooled cgroup, renames it after the machine, and writes its
limits only when they differ from those it was made with (the size asked for last).

Key decisions:

- A pooled cgroup is `<base>/_pool-<hex>` in every hierarchy the limits use (memory and cpu on v1,
  one directory on v2). Nothing ever joins one before it is claimed, so a pooled cgroup is always
  empty and can be removed at any time.
- Rename, not reuse under the pooled name: the machine's cgroup keeps its name (`<base>/<machine id>`,
  what an operator looks for). Where the kernel cannot rename (cgroup v2 has no rename), the pooled
  name is kept: handles carry the paths, so nothing else depends on the name.
- Never leaked without bound: after a crash, the next pool for the same base adopts what it finds
  (up to its size; the rest is removed) when its thread starts; `release` (the worker shutting down)
  removes every pooled cgroup under the bases. A pooled cgroup another process removed is noticed at
  `claim` (the rename fails) and the caller creates one the direct way.
- Only cgroups used by a machine carry counters that matter (oom_kill, failcnt), so used cgroups are
  removed, never recycled into the pool.
- One daemon thread per pool, started by the first `claim` and woken by each one; it only creates
  directories and writes limits, never blocks a claim for longer than a list pop.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

POOL_PREFIX = "_pool-"
POOL_SIZE = 4
RELEASE_PATIENCE = 5.0
# After a claim, how long the refill waits while the pool still has cgroups: creating one competes
# with the start that claimed (for the CPU, the GIL and the kernel's cgroup lock).
REFILL_DELAY = 0.005

Preset = tuple[int, int]  # (memory_mb, cpus) whose limits a pooled cgroup already has
# Writes a machine's limits into its directories (one per hierarchy, in the order of the bases).
ApplyLimits = Callable[[list[Path], int, int], None]


class _Pooled:
    """One pooled cgroup: its directory in each hierarchy, and the limits already written to it."""

    def __init__(self, dirs: list[Path], preset: Preset | None) -> None:
        self.dirs = dirs
        self.preset = preset

    def __repr__(self) -> str:
        return f"_Pooled({self.dirs[0].name}, preset={self.preset})"


def _remove_all(dirs: list[Path]) -> None:
    """rmdir, ignoring what is gone or (unexpectedly) busy: a pooled cgroup has no members."""
    for directory in dirs:
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove pooled cgroup %s: %s", directory, exc)


class CgroupPool:
    """Empty cgroups with limits preset, for the next machines; see the module docstring."""

    def __init__(self, apply: ApplyLimits, size: int = POOL_SIZE) -> None:
        self._apply = apply
        self.size = size
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._pooled: deque[_Pooled] = deque()
        self._bases: list[Path] = []
        self._want: Preset | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._renames = True  # False once the kernel refused a rename (cgroup v2)

    def __repr__(self) -> str:
        return f"CgroupPool(size={self.size}, pooled={len(self._pooled)}, want={self._want})"

    def __len__(self) -> int:
        return len(self._pooled)

    def claim(self, bases: list[Path], machine_id: str, memory_mb: int, cpus: int) -> list[Path] | None:
        """A pooled cgroup, now the machine's, with its limits written; None when there is none ready
        (the caller creates one). Wakes the refill either way."""
        with self._lock:
            if self._bases != bases:  # (first claim, or the hierarchies changed: old entries are no use)
                stale, self._pooled = list(self._pooled), deque()
                self._bases = list(bases)
            else:
                stale = []
            self._want = (memory_mb, cpus)
            pooled = self._pooled.popleft() if self._pooled else None
        try:
            for entry in stale:
                _remove_all(entry.dirs)
            return self._take(pooled, machine_id, memory_mb, cpus) if pooled is not None else None
        finally:
            with self._lock:
                self._start_refill()  # after the renames: mkdir and rename take the same kernel lock

    def release(self) -> None:
        """Stop refilling and remove every pooled cgroup under the bases (ours, and any a crashed
        predecessor left); a later `claim` starts again."""
        with self._lock:
            self._stopping = True
            thread, self._thread = self._thread, None
            pooled, self._pooled = list(self._pooled), deque()
            bases = list(self._bases)
        self._wake.set()
        if thread is not None:
            thread.join(RELEASE_PATIENCE)
        for entry in pooled:
            _remove_all(entry.dirs)
        for base in bases:
            _remove_all(_leftovers(base))
        with self._lock:
            self._stopping = False

    # -- claim ---------------------------------------------------------------------------------------

    def _take(self, pooled: _Pooled, machine_id: str, memory_mb: int, cpus: int) -> list[Path] | None:
        dirs = self._rename(pooled, machine_id)
        if dirs is not None and pooled.preset != (memory_mb, cpus):
            try:
                self._apply(dirs, memory_mb, cpus)
            except BaseException:
                _remove_all(dirs)
                raise
        return dirs

    def _rename(self, pooled: _Pooled, machine_id: str) -> list[Path] | None:
        """Each directory renamed after the machine where the kernel allows. None if the machine has
        cgroups already (a restart: the caller reuses them; the pooled one goes back to the pool) or
        the pooled one is gone (removed by someone else: what was renamed already is removed)."""
        named: list[Path] = []
        for directory in pooled.dirs:
            if not self._renames:
                named.append(directory)
                continue
            target = directory.with_name(machine_id)
            try:
                directory.rename(target)
                named.append(target)
            except FileNotFoundError:
                _remove_all(named + pooled.dirs[len(named) + 1 :])
                return None
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    self._renames = False  # cgroup v2: no rename; the pooled name does as well
                    named.append(directory)
                    continue
                for done, original in zip(named, pooled.dirs, strict=False):
                    done.rename(original)
                with self._lock:
                    self._pooled.appendleft(pooled)
                return None
        return named

    # -- refill --------------------------------------------------------------------------------------

    def _start_refill(self) -> None:
        """(Holding the lock.) Wake the refill thread, starting it if needed."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._refill_forever, name="fauxmad-cgroup-pool", daemon=True)
            self._thread.start()
        self._wake.set()

    def _refill_forever(self) -> None:
        self._adopt_leftovers()
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._pooled:  # not needed at once: let the start that woke us finish first
                time.sleep(REFILL_DELAY)
            if not self._refill():
                return

    def _refill(self) -> bool:
        """Create pooled cgroups until the pool is full; False once the pool is released."""
        while True:
            with self._lock:
                if self._stopping:
                    return False
                if len(self._pooled) >= self.size:
                    return True
                bases, want = list(self._bases), self._want
            entry = self._make(bases, want)
            if entry is None:
                return True  # retried at the next claim
            with self._lock:
                if not self._stopping and bases == self._bases:
                    self._pooled.append(entry)
                    continue
            _remove_all(entry.dirs)

    def _make(self, bases: list[Path], want: Preset | None) -> _Pooled | None:
        name = POOL_PREFIX + os.urandom(6).hex()
        dirs = [base / name for base in bases]
        made: list[Path] = []
        try:
            for directory in dirs:
                directory.mkdir()
                made.append(directory)
            if want is not None:
                self._apply(dirs, *want)
        except OSError as exc:
            log.warning("cannot pool a cgroup (%s): machines get theirs created at start", exc)
            _remove_all(made)
            return None
        return _Pooled(dirs, want)

    def _adopt_leftovers(self) -> None:
        """Pooled cgroups a previous worker on these bases left (it crashed): keep up to `size` of
        them (their limits unknown: written at claim), remove the rest."""
        with self._lock:
            bases = list(self._bases)
        if not bases:
            return
        names = {directory.name for base in bases for directory in _leftovers(base)}
        with self._lock:
            ours = {directory.name for entry in self._pooled for directory in entry.dirs}
        for name in sorted(names - ours):
            dirs = [base / name for base in bases]
            with self._lock:
                keep = not self._stopping and len(self._pooled) < self.size and all(d.is_dir() for d in dirs)
                if keep:
                    self._pooled.append(_Pooled(dirs, None))
            if not keep:
                _remove_all(dirs)


def _leftovers(base: Path) -> list[Path]:
    try:
        return [entry for entry in base.iterdir() if entry.name.startswith(POOL_PREFIX)]
    except OSError:
        return []
