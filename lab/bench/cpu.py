"""CPU per create: user+sys time of a set of processes, from /proc, over a measured stretch.

Latency says how long a create waits; CPU says what it costs the machine. A `CpuMeter` is given the
processes involved (nats-server, workers, brokers; or the floor's nats-server and responders) and takes a
snapshot of each one's `utime + stime` (/proc/<pid>/stat, clock ticks) and of its descendants' at
`start()` and at `stop()`; the difference over the creates measured in between is the CPU they cost.
A process that started in between counts whole; one that ended in between is lost (its ticks went to
its parent only when reaped), which is why descendants are walked at both snapshots.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import msgspec

PROC = Path("/proc")


def clock_ticks_per_second() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def parse_stat(text: str) -> tuple[int, int, int]:
    """(parent pid, utime, stime) of a /proc/<pid>/stat line; the command name may hold spaces and ')'."""
    fields = text.rsplit(")", 1)[1].split()
    # after the name: state(0) ppid(1) ... utime(11) stime(12), as numbered in proc(5) from 3 on
    return int(fields[1]), int(fields[11]), int(fields[12])


def ms_per_op(ticks: int, ops: int, hz: int) -> float | None:
    """CPU milliseconds per operation, from clock ticks; None when nothing was measured."""
    if ops <= 0 or hz <= 0:
        return None
    return round(ticks * 1000 / hz / ops, 3)


def _stats() -> dict[int, tuple[int, int]]:
    """Every process's (parent pid, utime+stime) right now."""
    out: dict[int, tuple[int, int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent, utime, stime = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        out[int(entry.name)] = (parent, utime + stime)
    return out


def tree_ticks(roots: Iterable[int]) -> dict[int, int]:
    """utime+stime (ticks) of each root pid and of every descendant of one, by pid."""
    stats = _stats()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    todo = [pid for pid in roots if pid in stats]
    seen: dict[int, int] = {}
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen[pid] = stats[pid][1]
        todo.extend(children.get(pid, ()))
    return seen


def ticks_between(before: dict[int, int], after: dict[int, int]) -> int:
    """CPU ticks spent between two snapshots: the rise of every process seen after (a new one counts whole)."""
    return sum(max(0, ticks - before.get(pid, 0)) for pid, ticks in after.items())


class CpuUse(msgspec.Struct, kw_only=True):
    """CPU spent over measured operations: total ticks, per operation, and the processes counted."""

    ticks: int
    ops: int
    ms_per_op: float | None
    processes: int


class Meter(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class CpuMeter:
    """`start()` ... `stop()` around measured work, as often as wanted; `use(ops)` sums the stretches."""

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)
        self.hz = clock_ticks_per_second()
        self.ticks = 0
        self.processes = 0
        self._before: dict[int, int] | None = None

    def start(self) -> None:
        self._before = tree_ticks(self.roots)

    def stop(self) -> None:
        if self._before is None:
            return
        after = tree_ticks(self.roots)
        self.ticks += ticks_between(self._before, after)
        self.processes = max(self.processes, len(after))
        self._before = None

    def use(self, ops: int) -> CpuUse:
        return CpuUse(
            ticks=self.ticks, ops=ops, ms_per_op=ms_per_op(self.ticks, ops, self.hz), processes=self.processes
        )


class SelfMeter:
    """The CPU of this process alone (the benchmark's client), `time.process_time` between start and stop."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began: float | None = None

    def start(self) -> None:
        self._began = time.process_time()

    def stop(self) -> None:
        if self._began is not None:
            self.seconds += time.process_time() - self._began
            self._began = None

    def ms_per_op(self, ops: int) -> float | None:
        return round(self.seconds * 1000 / ops, 3) if ops > 0 else None
