"""A typed client for the fleet: what the CLI, the reconcilers and other Python services call.

Every request method is one request on a documented subject: the brokers' `fauxmad.v1.api...`, and a
worker's own `fauxmad.v1.worker.ID...` only for what concerns that worker alone (cordon). Errors
arrive as the same `FauxmadError` classes the other side raised. The streams are read here too
(`events`, `logs`), so the CLI never holds a NATS connection of its own. It holds no state but the
connection.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.deadlines import caller_wait, volume_wait
from bus.contract.errors import NotFound
from bus.contract.fleet import (
    CordonRequest,
    CreateRequest,
    RegionSummary,
    SimulateRequest,
    WorkerInfo,
    WorkersListRequest,
)
from bus.contract.machines import (
    DestroyRequest,
    ExecReply,
    ExecRequest,
    ExitInfo,
    GetRequest,
    ListRequest,
    Machine,
    MachineConfig,
    ResumeRequest,
    SignalRequest,
    StartRequest,
    StopRequest,
    SuspendRequest,
    UpdateRequest,
    WaitRequest,
)
from bus.contract.volumes import (
    Volume,
    VolumeApiCreateRequest,
    VolumeApiListRequest,
    VolumeExtendRequest,
    VolumeIdRequest,
    VolumeSnapshot,
)
from bus.transport.connection import connect
from bus.transport.nats_adapter import Nats
from bus.transport.service import NoResponders, call, request
from orchestrator.logs import Emit, LogQuery, has_lines, read_logs
from orchestrator.restart import Ask
from orchestrator.view.history import EmitEvent, EventQuery, read_events

# A client-side wait ends for a reason: done, failed, or its timeout with no progress (docs/explanation/faults.md,
# "Deadlines that follow progress"); one that keeps making progress still ends at this many times its timeout
PROGRESS_CAP = 3.0


T = TypeVar("T")


class UpResult(msgspec.Struct, frozen=True, kw_only=True):
    """What `FleetClient.wait_up` saw: `up`, or `problem` (one line) and the machine as it was then."""

    up: bool
    machine: Machine
    problem: str = ""


def describe_exit(info: ExitInfo | None) -> str:
    if info is None:
        return "it ended"
    if info.oom_killed:
        return "it was killed: out of memory"
    if info.lost:
        return "it ended while its worker was down"
    if info.signal is not None:
        return f"it was killed by signal {info.signal}"
    return f"it exited with code {info.exit_code}"


def failure_reason(machine: Machine) -> str:
    """Why a machine that should be up is not, in one line: the reason of its newest `failed` or `stopped`
    event (a start that could not spawn its process says why: the image's pull, a volume), else how its
    process last ended. `machine` must carry its events (`get(..., events=True)`) for the first."""
    events = machine.events if isinstance(machine.events, list) else []
    ended = [e for e in events if e.type == "transition" and e.status in ("failed", "stopped") and e.reason]
    if ended:
        newest = max(ended, key=lambda e: (e.timestamp, e.seq))
        return str(newest.reason)
    return describe_exit(machine.exit) if machine.exit is not None else f"it is {machine.state}"


def _checks_problem(machine: Machine) -> str:
    """Empty when every check of the machine's config passes, else which do not and why."""
    failing = []
    for name in sorted(machine.config.checks):
        status = machine.checks.get(name)
        if status is None or status.status != "passing":
            what = f"{status.status}: {status.output}" if status is not None else "no result yet"
            failing.append(f"check {name} {what}"[:200])
    return "; ".join(failing)


class ConnectionLost(Exception):
    """The NATS connection ended for good while a read that has no end of its own (a follow) ran."""


class FleetClient:
    def __init__(self, nc: Nats, *, timeout: float = 10.0, edge: bool = False) -> None:
        """`edge`: an edge proxy's client on a secure fleet (role `proxy`): its create, start, stop, suspend and
        resume go to the brokers' edge verbs (`api.apps.<app>.edge.<verb>`, answered for apps with an
        `[http_service]` only), the only ones its identity may ask, and never straight to a worker."""
        self.nc = nc
        self.timeout = timeout
        self.edge = edge
        self.closed = asyncio.Event()  # set when a connection made by `connect` ends for good

    @classmethod
    async def connect(cls, url: str, name: str = "fauxmad-cli", *, creds: str | None = None) -> FleetClient:
        """`creds`: a secure fleet's credentials file (default: `$FAUXMAD_CREDS`)."""
        closed = asyncio.Event()
        client = cls(await connect(url, name, on_closed=lambda why: closed.set(), creds=creds))
        client.closed = closed
        return client

    async def close(self) -> None:
        await self.nc.close()

    def _wait(self, verb: str) -> float:
        """How long this client waits for `verb` (`bus.contract.deadlines`, from this client's base `timeout`)."""
        return caller_wait(verb, base=self.timeout)

    def _verb(self, app: str, verb: str) -> str:
        return subjects.api_edge(app, verb) if self.edge else subjects.api_machines(app, verb)

    async def create(self, app: str, req: CreateRequest) -> Machine:
        """Sent to the brokers of the machine's region (`api.apps.<app>.machines.create.<region>`), so in a
        supercluster the auction runs inside that region and a create from another region crosses the WAN once;
        when no broker listens there (older brokers, a region cut off), the fleet's subject, as before."""
        if not self.edge and subjects.TOKEN.fullmatch(req.region):
            with contextlib.suppress(NoResponders):
                subject = subjects.api_machines_create_in(app, req.region)
                return await call(self.nc, subject, req, Machine, timeout=self._wait("create"))
        return await call(self.nc, self._verb(app, "create"), req, Machine, timeout=self._wait("create"))

    async def run(self, app: str, region: str, config: MachineConfig, **options: Any) -> Machine:
        return await self.create(app, CreateRequest(region=region, config=config, **options))

    async def list(
        self, app: str, *, state: str | None = None, include_destroyed: bool = False
    ) -> builtins.list[Machine]:
        query = ListRequest(state=state, include_destroyed=include_destroyed)  # type: ignore[arg-type]
        subject = subjects.api_machines(app, "list")
        return await call(self.nc, subject, query, builtins.list[Machine], timeout=self.timeout)

    async def get(self, app: str, machine_id: str, *, events: bool = True) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "get"),
            GetRequest(id=machine_id, events=events),
            Machine,
            timeout=self.timeout,
        )

    async def start(self, app: str, machine_id: str, *, lease_nonce: str | None = None) -> Machine:
        return await call(
            self.nc,
            self._verb(app, "start"),
            StartRequest(id=machine_id, lease_nonce=lease_nonce),
            Machine,
            timeout=self._wait("start"),
        )

    async def stop(
        self,
        app: str,
        machine_id: str,
        *,
        signal: str = "SIGTERM",
        timeout: float = 10.0,
        lease_nonce: str | None = None,
    ) -> Machine:
        return await call(
            self.nc,
            self._verb(app, "stop"),
            StopRequest(id=machine_id, signal=signal, timeout=timeout, lease_nonce=lease_nonce),
            Machine,
            timeout=caller_wait("stop", timeout),
        )

    def asker(self, app: str) -> Ask:
        """`verb` of the app's machines asked of the brokers (the edge's, for an edge client), waited for as
        the contract's deadlines say: a restart's lease (`orchestrator.restart`) asks through it."""

        def ask(verb: str, request: Any, into: type[T]) -> Awaitable[T]:
            return call(self.nc, self._verb(app, verb), request, into, timeout=self._wait(verb))

        return ask

    async def suspend(self, app: str, machine_id: str) -> Machine:
        request = SuspendRequest(id=machine_id)
        return await call(self.nc, self._verb(app, "suspend"), request, Machine, timeout=self.timeout)

    async def resume(self, app: str, machine_id: str) -> Machine:
        request = ResumeRequest(id=machine_id)
        return await call(self.nc, self._verb(app, "resume"), request, Machine, timeout=self._wait("resume"))

    async def wake_on(self, worker_id: str, machine_id: str, verb: str) -> Machine:
        """`start` or `resume` asked of the machine's worker itself, as fly-proxy asks flyd: an edge proxy knows
        the worker from its route table, so the broker's hop (a lookup of the same routing index) is saved on the
        path of a held request. The worker checks leases and state exactly as it does for a broker."""
        if verb == "resume":
            return await call(
                self.nc,
                subjects.worker_machines(worker_id, "resume"),
                ResumeRequest(id=machine_id),
                Machine,
                timeout=self._wait("resume"),
            )
        return await call(
            self.nc,
            subjects.worker_machines(worker_id, "start"),
            StartRequest(id=machine_id),
            Machine,
            timeout=self._wait("start"),
        )

    async def destroy(self, app: str, machine_id: str, *, force: bool = False) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "destroy"),
            DestroyRequest(id=machine_id, force=force),
            Machine,
            timeout=self._wait("destroy"),
        )

    async def wait(self, app: str, machine_id: str, state: str, timeout: float = 60.0) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "wait"),
            WaitRequest(id=machine_id, state=state, timeout=timeout),  # type: ignore[arg-type]
            Machine,
            timeout=caller_wait("wait", timeout),
        )

    async def update(self, app: str, machine_id: str, config: MachineConfig) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "update"),
            UpdateRequest(id=machine_id, config=config),
            Machine,
            timeout=self._wait("update"),
        )

    async def signal(self, app: str, machine_id: str, signal: str) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "signal"),
            SignalRequest(id=machine_id, signal=signal),
            Machine,
            timeout=self.timeout,
        )

    async def exec(self, app: str, machine_id: str, cmd: builtins.list[str], *, timeout: float = 30.0) -> ExecReply:
        """Run `cmd` in a started machine (its environment, working directory and limits) and wait for it."""
        return await call(
            self.nc,
            subjects.api_machines(app, "exec"),
            ExecRequest(id=machine_id, cmd=cmd, timeout=timeout),
            ExecReply,
            timeout=caller_wait("exec", timeout),
        )

    async def wait_up(
        self, app: str, machine: Machine, *, up_for: float = 1.0, timeout: float = 60.0, poll: float = 0.1
    ) -> UpResult:
        """Watch a machine just started (`machine` is the start's answer) until it is up, or is not.

        Up: started, and then either every check of its config passing, or (with no checks) still
        running the same process `up_for` seconds later. Not up: it exited (any exit: a machine is
        meant to keep running), it restarted (a crash the restart policy hides), or `timeout` seconds passed
        without progress: the clock starts again when the machine reaches a state it was not seen in yet
        (its worker is working: replacing, starting, started), up to PROGRESS_CAP times `timeout` in all.
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + timeout
        restarts = machine.restarts
        current = machine
        up_since: float | None = None
        seen: set[str] = set()
        while True:
            now = loop.time()
            if current.state not in seen:
                seen.add(current.state)
                deadline = max(deadline, min(now + timeout, began + PROGRESS_CAP * timeout))
            problem = self._not_up(current, restarts)
            if problem:
                return UpResult(up=False, machine=current, problem=problem)
            if current.state == "started":
                up_since = now if up_since is None else up_since
                if current.config.checks:
                    if not _checks_problem(current):
                        return UpResult(up=True, machine=current)
                elif now - up_since >= up_for:
                    return UpResult(up=True, machine=current)
            if now >= deadline:
                why = _checks_problem(current) if current.state == "started" else f"it is {current.state}"
                return UpResult(up=False, machine=current, problem=f"not up, no progress for {timeout:g}s: {why}")
            await asyncio.sleep(poll)
            current = await self.get(app, machine.id, events=False)

    @staticmethod
    def _not_up(machine: Machine, restarts: int) -> str:
        if machine.restarts > restarts:
            count = machine.restarts - restarts
            times = "once" if count == 1 else f"{count} times"
            return f"{describe_exit(machine.exit)}, and its restart policy restarted it {times} (now {machine.state})"
        if machine.state in ("started", "starting", "replacing"):
            return ""
        if machine.state in ("stopped", "failed") and machine.exit is not None:
            return f"{describe_exit(machine.exit)} ({machine.state})"
        return f"it is {machine.state}"

    async def workers(self, region: str | None = None) -> builtins.list[WorkerInfo]:
        return await call(
            self.nc,
            subjects.API_WORKERS_LIST,
            WorkersListRequest(region=region),
            list[WorkerInfo],
            timeout=self.timeout,
        )

    async def regions(self) -> builtins.list[RegionSummary]:
        return await call(self.nc, subjects.API_REGIONS_LIST, b"", builtins.list[RegionSummary], timeout=self.timeout)

    async def simulate(self, req: SimulateRequest) -> dict[str, Any]:
        msg = await request(self.nc, subjects.API_PLACEMENTS_SIMULATE, req, timeout=self.timeout)
        result: dict[str, Any] = decode(dict[str, Any], msg.data)  # type: ignore[arg-type]
        return result

    async def cordon(self, worker_id: str, *, cordoned: bool = True, reason: str = "cli") -> WorkerInfo:
        """Stop (`cordoned=False`: resume) placing new machines on a worker; asked of the worker itself."""
        subject = subjects.worker_cordon(worker_id, cordoned)
        return await call(self.nc, subject, CordonRequest(reason=reason), WorkerInfo, timeout=5)

    # ------------------------------------------------------------------------------------------
    # the streams: events and logs

    async def events(self, query: EventQuery, emit: EmitEvent) -> int:
        """Machine events from stream FAUXMAD_EVENTS, oldest first (see `orchestrator.view.history`)."""
        return await read_events(self.nc, query, emit)

    async def logs(self, query: LogQuery, emit: Emit, *, must_exist: bool = False) -> int:
        """Machines' log lines from stream FAUXMAD_LOGS (see `orchestrator.logs`); returns how many.

        `must_exist` (one machine asked for by id): `NotFound` if the fleet does not know the machine
        and the stream holds none of its lines (a destroyed machine's logs outlive it). A follow that
        loses its connection raises `ConnectionLost` rather than waiting forever.
        """
        if must_exist:
            assert query.app is not None and query.machine_id is not None
            try:
                await self.get(query.app, query.machine_id)
            except NotFound:
                if not await has_lines(self.nc, query.app, query.machine_id):
                    raise
        reader = asyncio.ensure_future(read_logs(self.nc, query, emit))
        lost = asyncio.ensure_future(self.closed.wait())
        await asyncio.wait([reader, lost], return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()
        if not reader.done():
            reader.cancel()
            raise ConnectionLost("the connection to NATS was lost")
        return reader.result()

    # ------------------------------------------------------------------------------------------
    # volumes (docs/tutorials/images-and-volumes.md): the brokers' `fauxmad.v1.api.apps.<app>.volumes.<verb>`

    async def volume_create(
        self, app: str, region: str, name: str, size_gb: int = 1, *, snapshot_id: str | None = None
    ) -> Volume:
        req = VolumeApiCreateRequest(region=region, name=name, size_gb=size_gb, snapshot_id=snapshot_id)
        return await call(
            self.nc, subjects.api_volumes(app, "create"), req, Volume, timeout=volume_wait("create", base=self.timeout)
        )

    async def volume_list(self, app: str, *, include_destroyed: bool = False) -> builtins.list[Volume]:
        req = VolumeApiListRequest(include_destroyed=include_destroyed)
        return await call(self.nc, subjects.api_volumes(app, "list"), req, builtins.list[Volume], timeout=self.timeout)

    async def volume_get(self, app: str, volume_id: str) -> Volume:
        req = VolumeIdRequest(id=volume_id)
        return await call(self.nc, subjects.api_volumes(app, "get"), req, Volume, timeout=self.timeout)

    async def volume_extend(self, app: str, volume_id: str, size_gb: int) -> Volume:
        req = VolumeExtendRequest(id=volume_id, size_gb=size_gb)
        return await call(
            self.nc, subjects.api_volumes(app, "extend"), req, Volume, timeout=volume_wait("extend", base=self.timeout)
        )

    async def volume_destroy(self, app: str, volume_id: str) -> Volume:
        req = VolumeIdRequest(id=volume_id)
        return await call(
            self.nc,
            subjects.api_volumes(app, "destroy"),
            req,
            Volume,
            timeout=volume_wait("destroy", base=self.timeout),
        )

    async def volume_snapshot(self, app: str, volume_id: str) -> VolumeSnapshot:
        req = VolumeIdRequest(id=volume_id)
        subject = subjects.api_volumes(app, "snapshot")
        return await call(self.nc, subject, req, VolumeSnapshot, timeout=volume_wait("snapshot", base=self.timeout))

    async def volume_snapshots(self, app: str, volume_id: str) -> builtins.list[VolumeSnapshot]:
        req = VolumeIdRequest(id=volume_id)
        subject = subjects.api_volumes(app, "snapshots")
        return await call(self.nc, subject, req, builtins.list[VolumeSnapshot], timeout=self.timeout)
