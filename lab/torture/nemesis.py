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

On hosts (`fauxmad torture --hosts`), the network's faults too, each held for its draw then undone: `cut` (a
host's cable pulled: nothing in or out), `oneway` (every packet the host sends dropped, what it is sent still
arriving), `flap` (the cable pulled and put back every 0.3-1 s), `latency` (the host's link slowed, and in a
supercluster every gateway link delayed), `skew` (a worker restarted with its wall clock +3 s or -30 s off, then
restarted right), and in a supercluster `region` (a region's gateways cut: it is alone). While a region is cut
off the nemesis asks it, through its own servers, to place a machine and to list it: a `RegionProbe` record,
which the checker's `region-cut` judges (a cut-off region must go on placing and serving its own traffic).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from typing import Any

from bus.contract import subjects
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.transport.connection import connect
from lab.torture.fleet import MACHINE_CMD, MACHINE_CPUS, MACHINE_MEMORY_MB, TortureFleet, seconds_of
from lab.torture.history import Fault, HistoryWriter, Op, RegionProbe
from lab.torture.plan import FaultStep
from lab.torture.procs import MARKER_ENV
from orchestrator.client import FleetClient

RESERVES = f"{subjects.PREFIX}.worker.*.machines.reserve"
ARMED_FOR = 5.0  # seconds an on-reserve fault waits for a reserve before it strikes anyway
PROBE_APP = "torture-probe"  # the machines a cut-off region is asked to place
PROBE_ATTEMPT_S = 6.0  # one create of the region probe (asked again with its key when no answer came)
FLAP_S = (0.3, 1.0)  # a flapping link's down and up times


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
        self._probes = 0

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
            self.fleet.kill_nats(step.target)
            return "killed"
        if step.kind in ("cut", "flap"):
            self.fleet.cut(step.target)
            return "cable pulled" if step.kind == "cut" else "flapping"
        if step.kind == "oneway":
            self.fleet.cut_outgoing(step.target)
            return "its outgoing packets dropped"
        if step.kind == "latency":
            self.fleet.slow(step.target)
            return "its link slowed" + (", the WAN delayed" if self.fleet.topology == "supercluster" else "")
        if step.kind == "skew":
            self.fleet.skew(step.target, step.skew)
            return f"restarted with its clock {step.skew} off"
        if step.kind == "region":
            self.fleet.cut_region(step.target)
            return "its gateways cut"
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
        elif step.kind == "skew":  # a worker's restart takes a second or two: the clients go on meanwhile
            detail = await asyncio.to_thread(self._strike, step)
        else:
            detail = self._strike(step)
        fault = Fault(kind=step.kind, target=step.target, start=self._struck_at, trigger=trigger, detail=detail)
        if step.kind == "skew":
            fault.skew = seconds_of(step.skew)
        try:
            await self._hold(step)
        finally:
            if step.kind == "skew":
                await asyncio.to_thread(self._recover, step)
            else:
                self._recover(step)
            fault.end = time.time()
            self.faults.append(fault)
            self.history.write(fault)
            how = {"reserve": " as a reserve went out", "timeout": " (no reserve came)"}.get(trigger, "")
            self.progress(
                f"fault {len(self.faults)}: {step.kind} {step.target}{how}: {detail}; back after {step.hold:g}s"
            )

    async def _hold(self, step: FaultStep) -> None:
        """The fault held for its time: a flapping link goes down and up meanwhile; a cut-off region is probed."""
        until = self._struck_at + step.hold
        if step.kind == "flap":
            rng = random.Random(f"{step.at}-{step.target}")  # the same step flaps the same way
            down = True
            while (left := until - time.time()) > 0:
                await asyncio.sleep(min(left, rng.uniform(*FLAP_S)))
                if down:
                    self.fleet.heal(step.target)
                else:
                    self.fleet.cut(step.target)
                down = not down
            return
        if step.kind == "region":
            await self._probe_region(step.target, until)
        if (left := until - time.time()) > 0:
            await asyncio.sleep(left)

    async def _probe_region(self, region: str, until: float) -> None:
        """Through the cut-off region's own servers: a keyed create in the region (asked again with its key when
        no answer comes, until the cut ends), then the region's list of the probe's app, which must show it."""
        self._probes += 1
        key = f"probe-{region}-{self._probes}"
        probe = RegionProbe(region=region, at=time.time())
        config = MachineConfig(
            cmd=MACHINE_CMD,
            guest=Guest(cpus=MACHINE_CPUS, memory_mb=MACHINE_MEMORY_MB),
            env={MARKER_ENV: self.fleet.marker},
            metadata={"torture_key": key, "torture_client": "probe"},
        )
        client: FleetClient | None = None
        try:
            await asyncio.sleep(0.5)  # the cut takes hold: the gateways' connections drop
            client = FleetClient(
                await asyncio.wait_for(connect(self.fleet.region_url(region), "torture-probe", agent=True), 5.0),
                timeout=PROBE_ATTEMPT_S,
            )
            attempt = 0
            while not probe.placed and time.time() < until:
                attempt += 1
                op = Op(client="probe", step=self._probes, kind="create", app=PROBE_APP, invoke=time.time())
                op.key, op.region, op.attempt = key, region, attempt
                request = CreateRequest(region=region, config=config, idempotency_key=key)
                try:
                    machine = await asyncio.wait_for(client.create(PROBE_APP, request), PROBE_ATTEMPT_S)
                except Exception as exc:
                    op.complete, op.outcome, op.error = time.time(), "unknown", f"{type(exc).__name__}: {exc}"[:300]
                    probe.error = op.error
                    self.history.write(op)
                    await asyncio.sleep(0.2)  # a refusal comes back at once: not thousands of them in a cut
                    continue
                op.complete, op.outcome, op.machine_id, op.state = time.time(), "ok", machine.id, machine.state
                self.history.write(op)
                probe.placed, probe.machine_id, probe.error = True, machine.id, ""
            while probe.placed and not probe.served and time.time() < until:
                try:
                    found = await asyncio.wait_for(client.list(PROBE_APP), PROBE_ATTEMPT_S)
                    probe.served = any(m.id == probe.machine_id and m.state == "started" for m in found)
                except Exception as exc:
                    probe.error = f"listing {PROBE_APP}: {type(exc).__name__}: {exc}"[:300]
                if not probe.served:
                    await asyncio.sleep(0.3)
            if probe.placed and not probe.served and not probe.error:
                probe.error = f"{PROBE_APP}'s list never showed {probe.machine_id} started while the region was cut"
        except Exception as exc:
            probe.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            self.history.write(probe)
            self.progress(
                f"region {region} cut off: placed {probe.placed}, served {probe.served}"
                + (f" ({probe.error})" if probe.error else "")
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
        elif step.kind in ("cut", "flap"):
            self.fleet.heal(step.target)
        elif step.kind in ("oneway", "latency"):
            self.fleet.heal_link(step.target)
        elif step.kind == "skew":
            self.fleet.unskew(step.target)
        elif step.kind == "region":
            self.fleet.heal_region(step.target)
        elif step.kind == "cpu":
            self.fleet.feed()
        else:
            self.fleet.restart(step.target)
