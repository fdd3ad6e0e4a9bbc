"""How a process's end is told: the driver's `ExitStatus` and its stderr's last lines as an `ExitInfo`.

Two paths see a process end, the supervisor's watcher and a forced destroy; both must describe it
the same way, so the description lives here and not in either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from bus.contract.machines import ExitInfo
from workers.driver.base import ExitStatus
from workers.lifecycle.restart_policy import STDERR_TAIL_BYTES, tail_lines


def read_stderr_tail(path: Path) -> list[str]:
    """The last lines of a machine's stderr log (`ExitInfo.stderr_tail`): a bounded read of the file's end."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - STDERR_TAIL_BYTES)
            f.seek(start)
            data = f.read(STDERR_TAIL_BYTES)
    except OSError:
        return []
    return tail_lines(data, whole=start == 0)


def exit_info(status: ExitStatus, requested: bool, stderr_tail: Iterable[str], clock: Callable[[], float]) -> ExitInfo:
    """The exit as recorded on the machine; `clock` stands in for a finish time the driver could not tell."""
    return ExitInfo(
        exit_code=status.exit_code,
        signal=status.signal,
        oom_killed=status.oom_killed,
        requested_stop=requested,
        lost=status.lost,
        at=status.finished_at or clock(),
        stderr_tail=[*stderr_tail],
    )
