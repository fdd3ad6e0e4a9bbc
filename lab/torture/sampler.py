"""Samples of the fleet as the run goes, the final snapshot, and the operator probe.

Why it exists: some properties hold at every moment, not just at the end (one process per machine, no
worker reserving more than it has), so the run looks every ~0.75 s: the host's machine processes from
/proc (`lab.torture.procs`), each worker's own listing (asked of the worker itself, 0.5 s: a frozen or dead
worker is simply absent from that sample) and the heartbeats' capacity and use. The final snapshot is the
same look once the faults have stopped, every process is up and the fleet has settled, with every worker
required to answer. The probe then destroys one of the operator app's primaries directly and watches
the operator put the region back at its count. Last, the operator app's machine events are read from the
events stream: every start and stop the operator caused during the run, with the workers' times.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from bus.contract import subjects
from bus.contract.machines import ListRequest, Machine, MachineEvent
from bus.transport.connection import connect
from bus.transport.service import call
from lab.torture.history import Event, HistoryWriter, Listed, Probe, Sample, WorkerView
from lab.torture.procs import machine_processes
from orchestrator.client import FleetClient
from orchestrator.view.history import EventQuery

INTERVAL = 0.75


def listed(machine: Machine) -> Listed:
    meta = machine.config.metadata
    return Listed(
        id=machine.id,
        app=machine.app,
        state=machine.state,
        cpus=machine.config.guest.cpus,
        memory_mb=machine.config.guest.memory_mb,
        instance_id=machine.instance_id,
        key=meta.get("torture_key", ""),
        role=meta.get("fauxmad_role", ""),
    )


class Sampler:
    def __init__(self, workers: dict[str, str], marker: str, url: str, history: HistoryWriter) -> None:
        self.workers = workers
        self.marker = marker
        self.url = url
        self.history = history
        self.client: FleetClient | None = None
        self.phase = "run"

    async def open(self) -> None:
        self.client = FleetClient(await connect(self.url, "torture-sampler", agent=True), timeout=1.0)

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()

    async def _listing(self, worker_id: str, timeout: float) -> list[Listed] | None:
        assert self.client is not None
        subject = subjects.worker_machines(worker_id, "list")
        try:
            found = await call(self.client.nc, subject, ListRequest(), list[Machine], timeout=timeout)
        except Exception:
            return None
        return [listed(m) for m in found if m.state != "destroyed"]

    async def look(self, phase: str, timeout: float = 0.5) -> Sample:
        assert self.client is not None
        at = time.time()
        listings = await asyncio.gather(*(self._listing(w, timeout) for w in self.workers))
        beats: dict[str, tuple[list[int], list[int]]] = {}
        with contextlib.suppress(Exception):
            for info in await asyncio.wait_for(self.client.workers(), 2.0):
                have, use = info.capacity, info.used
                beats[info.worker_id] = ([have.cpus, have.memory_mb], [use.cpus, use.memory_mb])
        procs = await asyncio.to_thread(machine_processes, self.marker)
        views = []
        for (worker_id, region), found in zip(self.workers.items(), listings, strict=True):
            beat = beats.get(worker_id)
            views.append(
                WorkerView(
                    worker_id=worker_id,
                    region=region,
                    capacity=beat[0] if beat else None,
                    used=beat[1] if beat else None,
                    listed=found,
                )
            )
        return Sample(at=at, phase=phase, procs=procs, workers=views)

    async def run(self, stop: asyncio.Event) -> int:
        """Sample until `stop`; how many samples were written."""
        count = 0
        while not stop.is_set():
            self.history.write(await self.look(self.phase))
            count += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), INTERVAL)
        return count

    async def settled(self, timeout: float) -> bool:
        """Until every worker answers its listing and heartbeats (all up again); False at the deadline."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sample = await self.look("settle", timeout=1.0)
            if all(v.listed is not None and v.capacity is not None for v in sample.workers):
                return True
            await asyncio.sleep(0.5)
        return False

    async def final(self, timeout: float = 30.0) -> Sample:
        """The final snapshot: a look in which every worker answered (the last try if none did)."""
        deadline = time.monotonic() + timeout
        while True:
            sample = await self.look("final", timeout=2.0)
            if all(v.listed is not None for v in sample.workers) or time.monotonic() > deadline:
                self.history.write(sample)
                return sample
            await asyncio.sleep(0.5)

    async def probe(self, app: str, counts: dict[str, int], timeout: float = 30.0) -> Probe:
        """Destroy one started primary of the operator's app; wait until its region is back at its count."""
        assert self.client is not None
        fleet = FleetClient(self.client.nc, timeout=5.0)
        try:
            found = await fleet.list(app)
        except Exception as exc:
            probe = Probe(app=app, region="", machine_id="", destroyed_at=time.time(), timeout_s=timeout)
            probe.error = f"could not list {app}: {exc}"
            self.history.write(probe)
            return probe
        primaries = sorted(
            (m for m in found if m.state == "started" and m.config.metadata.get("fauxmad_role") == "primary"),
            key=lambda m: (m.region, m.id),
        )
        if not primaries:
            probe = Probe(app=app, region="", machine_id="", destroyed_at=time.time(), timeout_s=timeout)
            probe.error = f"{app} has no started primary to destroy"
            self.history.write(probe)
            return probe
        victim = primaries[0]
        probe = Probe(app=app, region=victim.region, machine_id=victim.id, destroyed_at=time.time(), timeout_s=timeout)
        try:
            await fleet.destroy(app, victim.id, force=True)
        except Exception as exc:
            probe.error = f"destroying {victim.id} failed: {exc}"
            self.history.write(probe)
            return probe
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                now = await fleet.list(app)
                up = [
                    m
                    for m in now
                    if m.region == victim.region
                    and m.id != victim.id
                    and m.state == "started"
                    and m.config.metadata.get("fauxmad_role") == "primary"
                ]
                if len(up) >= counts.get(victim.region, 0):
                    probe.restored_at = time.time()
                    break
            await asyncio.sleep(0.25)
        self.history.write(probe)
        return probe

    async def events(self, app: str, timeout: float = 20.0) -> int:
        """Write every transition of `app`'s machines in stream FAUXMAD_EVENTS; how many."""
        assert self.client is not None
        found: list[Event] = []

        def emit(_seq: int, event: MachineEvent) -> None:
            if event.type == "transition":
                found.append(
                    Event(
                        at=event.timestamp / 1000,  # the contract's event time is in ms
                        machine_id=event.machine_id,
                        region=event.region,
                        worker_id=event.worker_id,
                        status=event.status,
                        source=event.source,
                        reason=event.reason or "",
                    )
                )

        await asyncio.wait_for(self.client.events(EventQuery(app=app), emit), timeout)
        for record in found:
            self.history.write(record)
        return len(found)
