"""Counts the worker answers from on hot paths: machines by state, live machines per app, ports held.

An offer is answered inline for every create in the region, and the spread scorer needs to know how
many machines of the asking app this worker already runs; scanning LMDB per offer would cost O(machines).
The tally is derived from the store at start and kept in step by the commit hook, one machine at a time.
Destroyed machines count under their state but not under their app, and give their port back: a stopped
machine keeps its `PORT` for its next start, so a create must not hand it to another machine (picking one
would otherwise scan every machine).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from bus.contract.machines import Machine


class MachineTally:
    def __init__(self, machines: Iterable[Machine] = ()) -> None:
        self._state_of: dict[str, str] = {}
        self._app_of: dict[str, str] = {}
        self._port_of: dict[str, int] = {}
        self.states: Counter[str] = Counter()
        self.per_app: Counter[str] = Counter()
        self.ports: Counter[int] = Counter()  # held by machines not destroyed: a port is a key only while held
        for machine in machines:
            self.update(machine)

    def update(self, machine: Machine) -> None:
        """Record a machine's current state (called after every commit that touched it)."""
        before = self._state_of.get(machine.id)
        if before is not None:
            self.states[before] -= 1
            if before != "destroyed":
                self.per_app[self._app_of[machine.id]] -= 1
        self._state_of[machine.id] = machine.state
        self._app_of[machine.id] = machine.app
        self.states[machine.state] += 1
        if machine.state != "destroyed":
            self.per_app[machine.app] += 1
        self._hold_port(machine.id, None if machine.state == "destroyed" else machine.port)

    def _hold_port(self, machine_id: str, port: int | None) -> None:
        held = self._port_of.get(machine_id)
        if held == port:
            return
        if held is not None:
            self.ports[held] -= 1
            if self.ports[held] <= 0:
                del self.ports[held]
            del self._port_of[machine_id]
        if port is not None:
            self._port_of[machine_id] = port
            self.ports[port] += 1

    def state_counts(self) -> dict[str, int]:
        return {state: n for state, n in self.states.items() if n > 0}

    def app_counts(self) -> dict[str, int]:
        return {app: n for app, n in self.per_app.items() if n > 0}
