"""A typed client for the broker API: what the CLI, the reconcilers and other Python services call.

Every method is one request on a documented `fauxmad.v1.api...` subject; errors arrive as the same
`FauxmadError` classes the broker raised. It holds no state but the connection.
"""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import msgspec
from nats.aio.client import Client

from bus import subjects
from bus.codec import decode
from bus.connection import connect
from bus.messages import (
    CreateRequest,
    DestroyRequest,
    ExecReply,
    ExecRequest,
    ExitInfo,
    GetRequest,
    ListRequest,
    Machine,
    MachineConfig,
    RegionSummary,
    SignalRequest,
    SimulateRequest,
    StartRequest,
    StopRequest,
    UpdateRequest,
    WaitRequest,
    WorkerInfo,
    WorkersListRequest,
)
from bus.service import call, request


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


def _checks_problem(machine: Machine) -> str:
    """Empty when every check of the machine's config passes, else which do not and why."""
    failing = []
    for name in sorted(machine.config.checks):
        status = machine.checks.get(name)
        if status is None or status.status != "passing":
            what = f"{status.status}: {status.output}" if status is not None else "no result yet"
            failing.append(f"check {name} {what}"[:200])
    return "; ".join(failing)


class FleetClient:
    def __init__(self, nc: Client, *, timeout: float = 10.0) -> None:
        self.nc = nc
        self.timeout = timeout

    @classmethod
    async def connect(cls, url: str, name: str = "fauxmad-cli") -> FleetClient:
        return cls(await connect(url, name))

    async def close(self) -> None:
        await self.nc.close()

    async def create(self, app: str, req: CreateRequest) -> Machine:
        return await call(self.nc, subjects.api_machines(app, "create"), req, Machine, timeout=self.timeout + 20)

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

    async def start(self, app: str, machine_id: str) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "start"),
            StartRequest(id=machine_id),
            Machine,
            timeout=self.timeout + 20,
        )

    async def stop(self, app: str, machine_id: str, *, signal: str = "SIGTERM", timeout: float = 10.0) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "stop"),
            StopRequest(id=machine_id, signal=signal, timeout=timeout),
            Machine,
            timeout=timeout + 15,
        )

    async def destroy(self, app: str, machine_id: str, *, force: bool = False) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "destroy"),
            DestroyRequest(id=machine_id, force=force),
            Machine,
            timeout=self.timeout + 15,
        )

    async def wait(self, app: str, machine_id: str, state: str, timeout: float = 60.0) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "wait"),
            WaitRequest(id=machine_id, state=state, timeout=timeout),  # type: ignore[arg-type]
            Machine,
            timeout=timeout + 10,
        )

    async def update(self, app: str, machine_id: str, config: MachineConfig) -> Machine:
        return await call(
            self.nc,
            subjects.api_machines(app, "update"),
            UpdateRequest(id=machine_id, config=config),
            Machine,
            timeout=self.timeout + 30,
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
            timeout=timeout + 10,
        )

    async def wait_up(
        self, app: str, machine: Machine, *, up_for: float = 1.0, timeout: float = 60.0, poll: float = 0.1
    ) -> UpResult:
        """Watch a machine just started (`machine` is the start's answer) until it is up, or is not.

        Up: started, and then either every check of its config passing, or (with no checks) still
        running the same process `up_for` seconds later. Not up: it exited (any exit: a machine is
        meant to keep running), it restarted (a crash the restart policy hides), or `timeout` passed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        restarts = machine.restarts
        current = machine
        up_since: float | None = None
        while True:
            now = loop.time()
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
                return UpResult(up=False, machine=current, problem=f"not up within {timeout:g}s: {why}")
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
