"""This host's machine processes, read from /proc; and the signals that freeze and thaw a host.

Why it exists: the checker must know what really runs, not what the workers say runs (the two disagreeing
is one of the bugs it looks for). A worker gives every machine's process `FAUXMAD_MACHINE_ID`,
`FAUXMAD_INSTANCE_ID`, `FAUXMAD_WORKER_ID` and `FAUXMAD_APP` in its environment
(`workers/lifecycle/manager.py`), and the torture run adds `FAUXMAD_TORTURE=<marker>` to every machine it
makes, so this run's machines are told apart from any other fleet's on the same host.

Which process is the workload: a machine is a shim (its own session: sid == pid) that forks the workload
into a process group of its own (pgid == pid, in the shim's session: sid != pid). A shim spawned without
the worker's launcher carries the machine's environment too, so the environment alone would count it
twice; the session rule does not.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from lab.torture.history import Proc

MARKER_ENV = "FAUXMAD_TORTURE"
PROC = Path("/proc")


def _stat(pid: str) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgid, sid) of a process, or None if it is gone."""
    try:
        text = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def _environ(pid: str) -> dict[str, str] | None:
    try:
        raw = (PROC / pid / "environ").read_bytes()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key.startswith(b"FAUXMAD_"):
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def machine_processes(marker: str) -> list[Proc]:
    """Every live workload process of this run's machines (zombies are not running anything)."""
    found: list[Proc] = []
    for entry in PROC.iterdir():
        pid = entry.name
        if not pid.isdigit():
            continue
        env = _environ(pid)
        if not env or env.get(MARKER_ENV) != marker or "FAUXMAD_MACHINE_ID" not in env:
            continue
        stat = _stat(pid)
        if stat is None:
            continue
        state, _ppid, pgid, sid = stat
        if state in ("Z", "X") or pgid != int(pid) or sid == int(pid):
            continue  # a zombie, a shim (its own session), or a child of a workload
        found.append(
            Proc(
                machine_id=env["FAUXMAD_MACHINE_ID"],
                instance_id=env.get("FAUXMAD_INSTANCE_ID", ""),
                worker_id=env.get("FAUXMAD_WORKER_ID", ""),
                app=env.get("FAUXMAD_APP", ""),
                pid=int(pid),
                state=state,
            )
        )
    return found


def host_processes(worker_pid: int, worker_id: str, marker: str) -> list[int]:
    """A simulated host's processes: the worker, its descendants (its launcher, shims it spawned) and every
    process of this run whose environment names the worker (its machines, re-adopted ones included)."""
    children: dict[int, list[int]] = {}
    named: list[int] = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(entry.name)
        if stat is None:
            continue
        children.setdefault(stat[1], []).append(int(entry.name))
        env = _environ(entry.name)
        if env and env.get(MARKER_ENV) == marker and env.get("FAUXMAD_WORKER_ID") == worker_id:
            named.append(int(entry.name))
    tree: list[int] = [worker_pid]
    i = 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return list(dict.fromkeys([*tree, *named]))


def signal_all(pids: list[int], sig: signal.Signals) -> int:
    """Send `sig` to each pid that still exists; how many got it."""
    sent = 0
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            sent += 1
    return sent
