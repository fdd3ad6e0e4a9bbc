"""Named steps of a machine's lifecycle where a test may act: the product names them, tests decide what happens.

Some faults matter only at one exact step (a worker frozen right after it committed a reserve, killed right after
it spawned a machine's process) and cannot be timed from outside. The lifecycle calls `reached(step)` there; with
no hook installed that is one look at an empty list. A test that wants to act at a step names a module of its own
in `FAUXMAD_STEP_HOOKS` (`module:function`) when it starts the worker; the worker calls that function with
`on_step` once at start (`install_from_environment`), so the code that freezes or kills lives with the tests
(`tests/faults/points.py`), not in the product.

The steps: `reserve.committed` (a reserve's record is durable, before its answer), `launch.spawned` (a machine's
process exists, before its start is recorded).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

HOOKS_ENV = "FAUXMAD_STEP_HOOKS"

_hooks: list[Callable[[str], None]] = []


def on_step(hook: Callable[[str], None]) -> None:
    """Call `hook(step)` at every step reached from now on."""
    _hooks.append(hook)


def reached(step: str) -> None:
    for hook in _hooks:
        hook(step)


def install_from_environment() -> None:
    """Install the hooks `$FAUXMAD_STEP_HOOKS` names (`module:function`, called with `on_step`); nothing if unset."""
    named = os.environ.get(HOOKS_ENV, "")
    if not named:
        return
    module, _, function = named.partition(":")
    if not module or not function:
        raise ValueError(f"${HOOKS_ENV}: {named!r}: use module:function")
    getattr(importlib.import_module(module), function)(on_step)
