"""Fault-injection points for tests: a named step at which a process kills or freezes itself.

Some faults matter only at one exact step (a worker frozen right after it committed a reserve, killed right
after it spawned a machine's process) and cannot be timed from outside. A test names the steps in
`FAUXMAD_FAULT_POINTS` when it starts the process, e.g. `reserve.committed=freeze,launch.spawned=kill`; each
fires once. `freeze` is SIGSTOP of the process itself (the test sends SIGCONT), `kill` is SIGKILL. Outside
tests the variable is unset and `reached` is one look-up in an empty dict.
"""

from __future__ import annotations

import logging
import os
import signal

ENV = "FAUXMAD_FAULT_POINTS"
ACTIONS = {"freeze": signal.SIGSTOP, "kill": signal.SIGKILL}

log = logging.getLogger(__name__)


def _parse(text: str) -> dict[str, signal.Signals]:
    points: dict[str, signal.Signals] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, action = item.partition("=")
        if action not in ACTIONS:
            raise ValueError(f"${ENV}: {item!r}: use <step>=freeze or <step>=kill")
        points[name] = ACTIONS[action]
    return points


_armed = _parse(os.environ.get(ENV, ""))


def reached(step: str) -> None:
    """Fire the fault armed for `step`, if any (once)."""
    if not _armed:
        return
    signum = _armed.pop(step, None)
    if signum is not None:
        log.warning("fault point %s: %s", step, signum.name)
        os.kill(os.getpid(), signum)
