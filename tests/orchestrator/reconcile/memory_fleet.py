"""An in-memory fleet for the reconciler's unit tests: its ports (`Bus`, `MachinesApi`, `ReleaseStore`, `Clock`)
without a nats-server, and a clock that moves only when it is read.

It behaves like the real thing for what the reconciler uses, and no further: workers answer their machine
verbs by subject (list, lease, release, start, stop, update, destroy, cordon) with the workers' lease rule
(a verb under another holder's live lease is a 409), write the routing index after each transition and
beat every second of fake time; a create is a tiny auction (a live, uncordoned worker of the region with
room, not in `avoid_workers`, `prefer_away` last, fewest machines first) that raises `NoCapacity` as the
broker does. Requests and replies go through the bus codec, so a reply is a copy, as it is over the wire.
Machines start at once; a started machine's checks pass unless `healthy(config)` says otherwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import Conflict, NoCapacity, NotFound, Unreachable
from bus.contract.fleet import CordonRequest, CreateRequest, WorkerInfo
from bus.contract.machines import (
    CheckStatus,
    DestroyRequest,
    Lease,
    LeaseRequest,
    ListRequest,
    Machine,
    MachineConfig,
    MachineIndexEntry,
    ReleaseRequest,
    StartRequest,
    StopRequest,
    UpdateRequest,
)
from bus.contract.offers import Resources
from orchestrator.replicas.machines import MachineIndex
from orchestrator.replicas.workers import Registry

HEARTBEAT_EVERY = 1.0


class FakeClock:
    """Seconds that pass `tick` at a time, on every read: a loop that looks at the time makes it move, and
    a deadline is reached without anyone sleeping. Listeners hear each read (not the ones they cause)."""

    def __init__(self, now: float = 1_700_000_000.0, tick: float = 0.05) -> None:
        self.now = now
        self.tick = tick
        self.listeners: list[Callable[[float], None]] = []
        self._telling = False

    def __call__(self) -> float:
        self.now += self.tick
        if not self._telling:
            self._telling = True
            try:
                for listener in self.listeners:
                    listener(self.now)
            finally:
                self._telling = False
        return self.now


class MemoryStore:
    """`ReleaseStore` in a dict: `create` refuses a key that holds a value, as the KV's does."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def keys(self) -> list[str]:
        return list(self.values)

    async def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    async def create(self, key: str, value: bytes) -> bool:
        if key in self.values:
            return False
        self.values[key] = value
        return True

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def purge(self, key: str) -> None:
        self.values.pop(key, None)


class MemoryWorker:
    def __init__(self, fleet: MemoryFleet, worker_id: str, region: str, slots: int) -> None:
        self.fleet = fleet
        self.worker_id = worker_id
        self.region = region
        self.slots = slots  # machines of 1 cpu / 256 MB it has room for
        self.cordoned = False
        self.lost = False
        self.machines: dict[str, Machine] = {}

    def live_machines(self) -> list[Machine]:
        return [m for m in self.machines.values() if m.state != "destroyed"]

    def info(self, now: float) -> WorkerInfo:
        used = sum(m.config.guest.cpus for m in self.live_machines())
        return WorkerInfo(
            worker_id=self.worker_id,
            region=self.region,
            capacity=Resources(cpus=self.slots, memory_mb=256 * self.slots),
            used=Resources(cpus=used, memory_mb=256 * used),
            machines=len(self.live_machines()),
            cordoned=self.cordoned,
            heartbeat_at=now,
        )

    def verbs(self) -> dict[str, Callable[[Any], msgspec.Struct | list[Machine]]]:
        return {
            "list": self.list,
            "lease": self.lease,
            "release": self.release,
            "start": self.start,
            "stop": self.stop,
            "update": self.update,
            "destroy": self.destroy,
        }

    # -- the worker's verbs --------------------------------------------------------------------
    def list(self, req: ListRequest) -> list[Machine]:
        return [m for m in self.machines.values() if req.app in (None, m.app) and m.state != "destroyed"]

    def _require(self, machine_id: str, nonce: str | None = None) -> Machine:
        machine = self.machines.get(machine_id)
        if machine is None or machine.state == "destroyed":
            raise NotFound(f"machine {machine_id} not found")
        lease = machine.lease
        if lease is not None and lease.expires_at > self.fleet.clock.now and lease.nonce != nonce:
            raise Conflict(f"machine {machine_id} is leased by {lease.holder}")
        return machine

    def lease(self, req: LeaseRequest) -> Lease:
        machine = self._require(req.id, req.nonce)
        machine.lease = Lease(
            nonce=f"n{next(self.fleet.counter)}", holder=req.holder, expires_at=self.fleet.clock.now + req.ttl
        )
        return machine.lease

    def release(self, req: ReleaseRequest) -> Machine:
        machine = self._require(req.id, req.nonce)
        machine.lease = None
        return machine

    def start(self, req: StartRequest) -> Machine:
        machine = self._require(req.id, req.lease_nonce)
        if machine.state not in ("started", "starting"):
            self._run(machine, "started")
        return machine

    def stop(self, req: StopRequest) -> Machine:
        return self._run(self._require(req.id, req.lease_nonce), "stopped")

    def update(self, req: UpdateRequest) -> Machine:
        machine = self._require(req.id, req.lease_nonce)
        machine.config = req.config
        return self._run(machine, machine.state)  # a started machine restarts on its new config

    def destroy(self, req: DestroyRequest) -> Machine:
        machine = self._require(req.id, req.lease_nonce)
        if machine.state in ("started", "starting") and not req.force:
            raise Conflict(f"machine {req.id} is {machine.state}; stop it first or destroy with force")
        return self._run(machine, "destroyed")

    def _run(self, machine: Machine, state: str) -> Machine:
        """A transition: the new state, its checks, and the routing index written, as a worker does."""
        machine.state = state  # type: ignore[assignment]
        machine.updated_at = self.fleet.stamp()
        healthy = state == "started" and self.fleet.healthy(machine.config)
        machine.checks = {
            name: CheckStatus(name=name, status="passing" if healthy else "critical", output="" if healthy else "down")
            for name in machine.config.checks
        }
        if state == "destroyed":
            self.fleet.index.apply(machine.id, None)
        else:
            entry = MachineIndexEntry(
                id=machine.id,
                worker_id=self.worker_id,
                region=self.region,
                app=machine.app,
                state=state,
                name=machine.name,
                metadata=dict(machine.config.metadata),
            )
            self.fleet.index.apply(machine.id, encode(entry))
        return machine


class MemoryFleet:
    """`Bus` (workers by subject) and `MachinesApi` (the brokers' creates) over workers in memory."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.workers: dict[str, MemoryWorker] = {}
        self.creates: list[CreateRequest] = []  # every create the brokers were asked for, in order
        self.healthy: Callable[[MachineConfig], bool] = lambda config: True
        self.counter = itertools.count(1)
        self.registry = Registry(clock=clock)
        self.index = MachineIndex()
        self._routes: dict[str, Callable[[Any], Any]] = {}
        self._beat_at = 0.0
        clock.listeners.append(self._tick)

    def follow(self, registry: Registry, index: MachineIndex) -> None:
        """Let a reconciler's replicas see this fleet, as a KV watch would: current values first, then changes."""
        self.registry, self.index = registry, index
        self.beat(self.clock.now)
        for worker in self.workers.values():
            for machine in worker.live_machines():
                worker._run(machine, machine.state)

    def stamp(self) -> str:
        return datetime.fromtimestamp(self.clock.now, UTC).isoformat()

    def add_worker(self, worker_id: str, region: str, slots: int = 8) -> MemoryWorker:
        worker = self.workers[worker_id] = MemoryWorker(self, worker_id, region, slots)
        for verb, handler in worker.verbs().items():
            self._routes[subjects.worker_machines(worker_id, verb)] = handler
        for cordon in (True, False):
            self._routes[subjects.worker_cordon(worker_id, cordon)] = self._cordoner(worker, cordon)
        self.beat(self.clock.now)
        return worker

    def _cordoner(self, worker: MemoryWorker, cordon: bool) -> Callable[[CordonRequest], WorkerInfo]:
        def handle(req: CordonRequest) -> WorkerInfo:
            worker.cordoned = cordon
            self.beat(self.clock.now)
            return worker.info(self.clock.now)

        return handle

    def lose(self, worker_id: str) -> None:
        """The host goes away: nobody answers on its subjects and its heartbeat key expires."""
        worker = self.workers[worker_id]
        worker.lost = True
        for verb in worker.verbs():
            self._routes.pop(subjects.worker_machines(worker_id, verb), None)
        self.registry.apply(f"{worker.region}.{worker_id}", None)

    def beat(self, now: float) -> None:
        self._beat_at = now
        for worker in self.workers.values():
            if not worker.lost:
                self.registry.apply(f"{worker.region}.{worker.worker_id}", encode(worker.info(now)))

    def _tick(self, now: float) -> None:
        if now - self._beat_at >= HEARTBEAT_EVERY:
            self.beat(now)

    def machines(self, app: str | None = None) -> list[Machine]:
        return [m for w in self.workers.values() for m in w.live_machines() if app in (None, m.app)]

    # -- Bus -----------------------------------------------------------------------------------
    async def call(self, subject: str, request: msgspec.Struct, reply: type[Any], *, timeout: float) -> Any:
        handler = self._routes.get(subject)
        if handler is None:
            raise Unreachable(f"nobody answers on {subject}")
        kind = type(request)
        answer = handler(decode(kind, encode(request)))
        return decode(reply, encode(answer))

    # -- MachinesApi ---------------------------------------------------------------------------
    async def create(self, app: str, req: CreateRequest) -> Machine:
        req = decode(CreateRequest, encode(req))
        self.creates.append(req)
        candidates = [
            w
            for w in self.workers.values()
            if w.region == req.region
            and not w.lost
            and not w.cordoned
            and w.worker_id not in req.avoid_workers
            and len(w.live_machines()) < w.slots
        ]
        if not candidates:
            raise NoCapacity(f"no worker in {req.region} has room")
        worker = min(
            candidates,
            key=lambda w: (w.worker_id in req.prefer_away, sum(m.app == app for m in w.live_machines()), w.worker_id),
        )
        number = next(self.counter)
        machine = Machine(
            id=f"{number:014x}",  # a worker's id: 14 hex digits
            name=f"{app}-{number}",
            app=app,
            region=req.region,
            worker_id=worker.worker_id,
            state="created",
            config=req.config,
            instance_id="",
            created_at=self.stamp(),
            updated_at=self.stamp(),
        )
        worker.machines[machine.id] = machine
        worker._run(machine, "created" if req.skip_launch else "started")
        return decode(Machine, encode(machine))

    def _find(self, app: str, machine_id: str) -> tuple[MemoryWorker, Machine]:
        for worker in self.workers.values():
            machine = worker.machines.get(machine_id)
            if machine is not None and machine.app == app and machine.state != "destroyed" and not worker.lost:
                return worker, machine
        raise NotFound(f"machine {machine_id} not found in app {app}")

    async def get(self, app: str, machine_id: str, *, events: bool = True) -> Machine:
        return decode(Machine, encode(self._find(app, machine_id)[1]))

    async def destroy(self, app: str, machine_id: str, *, force: bool = False) -> Machine:
        worker, _ = self._find(app, machine_id)
        return decode(Machine, encode(worker.destroy(DestroyRequest(id=machine_id, force=force))))
