"""Callers waiting for a machine to reach a state, woken by the commit that gets it there.

`wait` and `stop` block on a state, not on a process: whichever path commits the state (a verb,
an exit, a restart, a resume) wakes them, because every commit passes its machines to `notify`.
A machine destroyed meanwhile fails its waiters at once instead of letting them time out.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable

from bus.contract.errors import Conflict
from bus.contract.machines import Machine


class Waiters:
    def __init__(self) -> None:
        self._waiting: defaultdict[str, list[tuple[frozenset[str], asyncio.Future[Machine]]]] = defaultdict(list)

    def add(self, machine_id: str, states: Iterable[str]) -> asyncio.Future[Machine]:
        """A future that resolves to the machine once a commit leaves it in one of `states`."""
        future: asyncio.Future[Machine] = asyncio.get_running_loop().create_future()
        self._waiting[machine_id].append((frozenset(states), future))
        return future

    def notify(self, machine: Machine) -> None:
        waiters = self._waiting.get(machine.id)
        if not waiters:
            return
        remaining = []
        for states, future in waiters:
            if future.done():
                continue
            if machine.state in states:
                future.set_result(machine)
            elif machine.state == "destroyed":
                future.set_exception(Conflict(f"machine {machine.id} was destroyed"))
            else:
                remaining.append((states, future))
        if remaining:
            self._waiting[machine.id] = remaining
        else:
            self._waiting.pop(machine.id, None)
