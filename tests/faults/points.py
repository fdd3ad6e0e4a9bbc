"""Fault points, the tests' own: a worker kills or freezes itself at a named step of its lifecycle.

The worker names its steps (`workers.lifecycle.steps`) and calls, once at start, the function that
`$FAUXMAD_STEP_HOOKS` names; a test starts it with `FAUXMAD_STEP_HOOKS=tests.faults.points:install` (`ENVIRONMENT`)
and the steps in `FAUXMAD_FAULT_POINTS`, e.g. `reserve.committed=freeze,launch.spawned=kill`; each fires once.
`freeze` is SIGSTOP of the process itself (the test sends SIGCONT), `kill` is SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

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
HOOKS = "tests.faults.points:install"


def environment(points: str) -> dict[str, str]:
    """What a worker's environment needs for the fault `points` (`step=freeze|kill`, comma-separated)."""
    _parse(points)
    return {ENV: points, "FAUXMAD_STEP_HOOKS": HOOKS}


def install(on_step: Callable[[Callable[[str], None]], None]) -> None:
    on_step(reached)


def reached(step: str) -> None:
    """Fire the fault armed for `step`, if any (once)."""
    signum = _armed.pop(step, None)
    if signum is not None:
        log.warning("fault point %s: %s", step, signum.name)
        os.kill(os.getpid(), signum)
