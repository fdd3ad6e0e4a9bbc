"""The nemesis: carries out the seeded fault schedule against the fleet's real processes.

Why it exists: the faults a fleet meets are process deaths and stalls at the worst moment, not at a
convenient one. One fault at a time (the next waits for the last one's recovery, so a schedule always
means the same thing): kill -9 of a worker (restarted 1-4 s later on the same data dir with the same id),
of a broker or of the operator (restarted), of nats-server (restarted 1-3 s later on the same port and
store), SIGSTOP of a worker and its host's processes for 3-8 s, then SIGCONT, or the whole host starved of
CPU for 3-8 s (stress-ng, 4 hogs per core), so that every process is slow at once.

The worst moment: a kill or freeze marked `on_reserve` is armed at its time and strikes the instant a
reserve goes out to its worker. The nemesis listens on the contract's own subject
(`fauxmad.v1.worker.<id>.machines.reserve`) like any other subscriber and signals the worker from the
message callback, so the worker dies or stops with the reserve in flight: no hook in product code. If no
reserve comes within a few seconds, it strikes anyway (trigger `timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from bus.contract import subjects
from bus.transport.connection import connect
from lab.torture.fleet import TortureFleet
from lab.torture.history import Fault, HistoryWriter
from lab.torture.plan import FaultStep

RESERVES = f"{subjects.PREFIX}.worker.*.machines.reserve"
ARMED_FOR = 5.0  # seconds an on-reserve fault waits for a reserve before it strikes anyway


class Nemesis:
    def __init__(
        self,
        fleet: TortureFleet,
        schedule: list[FaultStep],
        history: HistoryWriter,
        url: str,
        progress: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.fleet = fleet
        self.progress = progress
        self.schedule = schedule
        self.history = history
        self.url = url
        self._armed: FaultStep | None = None
        self._struck: asyncio.Event = asyncio.Event()
        self._struck_at = 0.0
        self.faults: list[Fault] = []

    async def run(self, t0: float) -> None:
        """Every fault of the schedule, each at its time (or after the last one's recovery)."""
        nc = await connect(self.url, "torture-nemesis", agent=True)
        sub = await nc.subscribe(RESERVES, cb=self._on_reserve)
        try:
            for step in self.schedule:
                delay = t0 + step.at - time.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._one(step)
        finally:
            self._armed = None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await nc.close()

    async def _on_reserve(self, msg: Any) -> None:
        step = self._armed
        if step is None:
            return
        worker_id = str(msg.subject).split(".")[3]
        if worker_id != step.target:
            return
        self._armed = None
        self._strike(step)  # at once, in the callback: the reserve is still on its way to the worker
        self._struck.set()

    def _strike(self, step: FaultStep) -> str:
        """Kill or freeze now; what was done, in a few words."""
        self._struck_at = time.time()
        if step.kind == "kill":
            return "killed" if self.fleet.kill(f"worker-{step.target}") else "was not running"
        if step.kind == "freeze":
            return f"froze {self.fleet.freeze(step.target)} processes"
        if step.kind == "nats":
            self.fleet.kill_nats()
            return "killed"
        if step.kind == "cpu":
            return f"started {self.fleet.starve(step.hold)} CPU hogs"
        return "killed" if self.fleet.kill(step.target) else "was not running"

    async def _one(self, step: FaultStep) -> None:
        trigger = "schedule"
        if step.on_reserve:
            self._struck.clear()
            self._armed = step
            try:
                await asyncio.wait_for(self._struck.wait(), ARMED_FOR)
                trigger, detail = "reserve", self._detail(step)
            except TimeoutError:
                self._armed = None
                trigger, detail = "timeout", self._strike(step)
        else:
            detail = self._strike(step)
        fault = Fault(kind=step.kind, target=step.target, start=self._struck_at, trigger=trigger, detail=detail)
        try:
            await asyncio.sleep(step.hold)
        finally:
            self._recover(step)
            fault.end = time.time()
            self.faults.append(fault)
            self.history.write(fault)
            how = {"reserve": " as a reserve went out", "timeout": " (no reserve came)"}.get(trigger, "")
            self.progress(
                f"fault {len(self.faults)}: {step.kind} {step.target}{how}: {detail}; back after {step.hold:g}s"
            )

    def _detail(self, step: FaultStep) -> str:
        return f"froze {len(self.fleet.frozen.get(step.target, []))} processes" if step.kind == "freeze" else "killed"

    def _recover(self, step: FaultStep) -> None:
        if step.kind == "kill":
            self.fleet.restart(f"worker-{step.target}")
        elif step.kind == "freeze":
            self.fleet.thaw(step.target)
        elif step.kind == "nats":
            self.fleet.start_nats()
        elif step.kind == "cpu":
            self.fleet.feed()
        else:
            self.fleet.restart(step.target)
