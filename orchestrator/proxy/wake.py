"""Machines started or created inside a request (autostart, scale from zero).

A request that finds no started machine under its soft limit resumes a suspended one (`resume`: the
process continues where it was frozen) or starts a stopped one (`start`), asking the machine's worker
directly (`fauxmad.v1.worker.<id>.machines.<verb>`, the worker the route table names, as fly-proxy asks
flyd; through a broker only for a machine the table does not know yet, and always for a secure fleet's proxy
identity, whose role asks only the brokers' edge verbs), or, with `auto_create`, creates one
through the brokers in a region that may have another (`create`, which the broker starts in the same leg);
it is then held until the machine accepts a TCP connection, and that connection serves it. One start per
machine and one create per app and region are in flight at a time: a burst of requests shares them. Until
the index's watch catches up, the start's reply is the table's entry for the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from bus.contract.errors import FauxmadError
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Machine, MachineIndexEntry, index_entry
from orchestrator.apps.ownership import CREATED_BY_KEY, CREATED_FOR_KEY
from orchestrator.apps.spec import PRIMARY
from orchestrator.client import FleetClient
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Pool, connect_when_up

# why a request wakes a machine: `choose` starts one only when no started machine is under its soft limit
WHY_START = "a request found no started machine under its soft limit"


class Woken(msgspec.Struct, frozen=True):
    """A machine started, resumed or created for a request: what the proxy logs and counts."""

    app: str
    machine_id: str
    region: str
    kind: str  # "start" | "resume" | "create"
    why: str


class WakeError(Exception):
    """A start or create for a request did not give a machine that accepts connections; the reason."""


class Waker:
    def __init__(
        self,
        client: FleetClient,
        routes: RouteTable,
        pool: Pool,
        *,
        ready_timeout: float = 10.0,
        on_woken: Callable[[Woken], None] = lambda woken: None,
    ) -> None:
        self.client = client
        self.routes = routes
        self.pool = pool
        self.ready_timeout = ready_timeout
        self.on_woken = on_woken  # once the machine accepts connections (the proxy counts it and says so)
        self.starting: dict[str, asyncio.Future[MachineIndexEntry]] = {}
        self._readying: set[str] = set()  # machines started or created for requests, not accepting connections yet
        self._creating: dict[tuple[str, str], asyncio.Future[MachineIndexEntry]] = {}

    async def start(self, app: str, machine_id: str) -> MachineIndexEntry:
        return await asyncio.shield(self.begin(app, machine_id))

    def waking(self) -> set[str]:
        """The machines requests wait for now (their start, resume or create in flight, or their port not open
        yet): in use, for this proxy's autostop and for its peers' (`idle.IdleStopper`), though no request has
        reached them. A peer that stopped one because it saw it started and unused would undo the wake."""
        return self._readying | self.starting.keys()

    def begin(self, app: str, machine_id: str, *, ahead: bool = False) -> asyncio.Future[MachineIndexEntry]:
        """The machine's start (or resume), begun now or the one in flight: never cancel it, others share it.
        `ahead`: a request went to the suspended machine on a kept connection (`ahead.resume_ahead`), and its
        answer will show the machine serves: no connection is opened to show it."""
        pending = self.starting.get(machine_id)
        if pending is None:
            pending = self.starting[machine_id] = asyncio.ensure_future(self._start(app, machine_id, ahead))
            pending.add_done_callback(lambda _: self.starting.pop(machine_id, None))
        return pending

    async def create(self, app: App, region: str) -> MachineIndexEntry:
        key = (app.name, region)
        pending = self._creating.get(key)
        if pending is None:
            pending = self._creating[key] = asyncio.ensure_future(self._create(app, region))
            pending.add_done_callback(lambda _: self._creating.pop(key, None))
        return await asyncio.shield(pending)

    async def _start(self, app: str, machine_id: str, ahead: bool = False) -> MachineIndexEntry:
        entry = self.routes.entry(machine_id)
        kind = "resume" if entry is not None and entry.state in ("suspended", "suspending") else "start"
        try:
            if entry is not None and entry.worker_id and not self.client.edge:  # a proxy role asks the brokers
                machine = await self.client.wake_on(entry.worker_id, machine_id, kind)
            elif kind == "resume":
                machine = await self.client.resume(app, machine_id)
            else:
                machine = await self.client.start(app, machine_id)
        except (FauxmadError, TimeoutError) as exc:
            raise WakeError(f"{'resuming' if kind == 'resume' else 'starting'} {machine_id} failed: {exc}") from None
        return await self._ready(machine, kind, WHY_START, ahead)

    async def _create(self, app: App, region: str) -> MachineIndexEntry:
        if app.spec is None:
            raise WakeError(f"{app.name} has no release to create a machine from")
        config = app.spec.machine_config(app.release, PRIMARY)
        why = f"a request found no machine to serve it in {region}"
        origin = {CREATED_BY_KEY: "proxy", CREATED_FOR_KEY: why}
        config = msgspec.structs.replace(config, metadata={**config.metadata, **origin})
        try:
            machine = await self.client.create(app.name, CreateRequest(region=region, config=config))
        except (FauxmadError, TimeoutError) as exc:
            raise WakeError(f"creating a machine in {region} failed: {exc}") from None
        return await self._ready(machine, "create", why)

    async def _ready(self, machine: Machine, kind: str, why: str, ahead: bool = False) -> MachineIndexEntry:
        if machine.state != "started" or machine.port is None:
            raise WakeError(f"{machine.id} is {machine.state} after its {kind}")
        entry = index_entry(machine)
        self.routes.remember(entry)
        address = self.pool.address(entry, self.port_of(entry))
        if kind == "resume" and (ahead or self.pool.has_idle(address)):
            # it listened before it was frozen, and connections kept from then are served again now: a new
            # connection would prove nothing (the kernel queues connects to a frozen process) and cost the
            # app an accept (and a fork, for an app with a process per connection) on the held request
            self.on_woken(Woken(machine.app, machine.id, machine.region, kind, why))
            return entry
        self._readying.add(machine.id)
        try:
            conn = await connect_when_up(address, self.ready_timeout, pool=self.pool)
        finally:
            self._readying.discard(machine.id)
        if conn is None:
            raise WakeError(
                f"{machine.id} did not accept connections on port {address.port} within {self.ready_timeout:g}s"
            )
        self.pool.put(conn)
        self.on_woken(Woken(machine.app, machine.id, machine.region, kind, why))
        return entry

    def port_of(self, entry: MachineIndexEntry) -> int:
        app = self.routes.app(entry.app)
        internal = app.service.internal_port if app is not None else None
        return internal or entry.port or 0
