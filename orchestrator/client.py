"""A typed client for the broker API: what the CLI, the reconcilers and other Python services call.

Every method is one request on a documented `fauxmad.v1.api...` subject; errors arrive as the same
`FauxmadError` classes the broker raised. It holds no state but the connection.
"""

from __future__ import annotations

import builtins
from typing import Any

from nats.aio.client import Client

from bus import subjects
from bus.codec import decode
from bus.connection import connect
from bus.messages import (
    CreateRequest,
    DestroyRequest,
    GetRequest,
    ListRequest,
    Machine,
    MachineConfig,
    RegionSummary,
    SimulateRequest,
    StartRequest,
    StopRequest,
    UpdateRequest,
    WaitRequest,
    WorkerInfo,
    WorkersListRequest,
)
from bus.service import call, request


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

    async def get(self, app: str, machine_id: str) -> Machine:
        return await call(
            self.nc, subjects.api_machines(app, "get"), GetRequest(id=machine_id), Machine, timeout=self.timeout
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
