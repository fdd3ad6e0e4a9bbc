"""What the process driver reads of /proc: a process's stat (state, parent, group, session, start time), its
memory, whether it is in a job-control stop, and which processes belong to a session or name a machine.

Its own module because the driver decides from these reads and never writes here; the reads are the part a
newcomer needs when a machine is said to run, stop or be gone, and they are plain functions of a pid.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from workers.driver.base import TaskHandle
from workers.driver.fork_server import proc_stat_fields

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class ProcStat(NamedTuple):
    state: str
    parent: int
    group: int
    session: int
    start_ticks: int

    def in_session_of(self, handle: TaskHandle, pid: int) -> bool:
        """Whether process `pid` (whose stat this is) is the task's workload: in its shim's session, or a
        session of its own (a sandbox: its id is the pid in `child.pid`)."""
        return self.session in (handle.pid, pid)


def proc_stat(pid: int) -> ProcStat | None:
    """State, parent, group, session and start time of a process from /proc/<pid>/stat, None if there is none."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    # fields[0] is field 3 (state); ppid is field 4, pgrp field 5, session field 6, starttime field 22.
    return ProcStat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def stopped(pid: int) -> bool:
    """Is the process group `pid` leads in a job-control stop? Its leader's state says so (`T`), except
    while the leader waits in vfork() for a child the stop caught before its exec (dash starts every
    command that way): the leader is then `D`, and the members decide (`group_stopped`)."""
    leader = proc_stat(pid)
    if leader is None:
        return False
    if leader.state != "D":
        return leader.state == "T"
    return group_stopped(group_states(pid))


def rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def same_process(handle: TaskHandle) -> bool:
    stat = proc_stat(handle.pid)
    return stat is not None and stat.start_ticks == handle.start_ticks


def alive(handle: TaskHandle) -> bool:
    """The handle's shim is running: same pid, same start time, and not a zombie."""
    stat = proc_stat(handle.pid)
    return stat is not None and stat.start_ticks == handle.start_ticks and stat.state not in ("Z", "X")


def session_members(session: int) -> list[int]:
    """The processes of session `session` (a shim's: the shim and its workload, sandbox or not)."""
    return [pid for pid, stat in every_process() if stat.session == session]


def processes_of(machine_id: str) -> list[int]:
    """The processes whose environment names `machine_id` (a machine's workload and what it started)."""
    needle = f"FAUXMAD_MACHINE_ID={machine_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry.name))
    return found


def group_stopped(states: Iterable[str]) -> bool:
    """Whether a process group whose members are in `states` (from /proc) is in a job-control stop: one is
    stopped (`T`) and none runs or sleeps (`R`, `S`); a member in `D` may be a parent waiting in vfork()
    for a stopped child, so it decides nothing, and neither do zombies."""
    seen = set(states)
    return "T" in seen and not seen & {"R", "S"}


def group_states(pgid: int) -> list[str]:
    """The states of the processes in group `pgid` (a scan of /proc: only when the leader is in `D`)."""
    return [stat.state for _, stat in every_process() if stat.group == pgid]


def every_process() -> Iterator[tuple[int, ProcStat]]:
    """Each process there is now, with its /proc stat (one gone meanwhile is left out)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            yield int(entry), stat
