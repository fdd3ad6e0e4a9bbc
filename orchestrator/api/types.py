"""The HTTP request and response bodies, with Fly's field names, and their translation to the bus's types.

These Structs both validate requests (strict: an unknown field is a 400) and generate `/openapi.json`, so
the document cannot drift from what the server accepts.
"""

from __future__ import annotations

import signal
from typing import Annotated, Any, Literal

import msgspec

from bus.contract.base import State
from bus.contract.machines import Guest, Machine, MachineConfig, MachineEvent, Mount, RestartPolicy
from bus.contract.volumes import Volume


class Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Base of every request body: unknown fields are an error, not silently ignored."""


Arg = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$", max_length=65536)]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[^=\x00]+$", max_length=1024)]


class FlyInit(Body):
    """The command: `exec` if given, else `entrypoint` + `cmd`; none of them: the image's own (its manifest's)."""

    exec: Annotated[list[Arg], msgspec.Meta(min_length=1)] | None = None
    entrypoint: list[Arg] | None = None
    cmd: list[Arg] | None = None


class FlyGuest(Body):
    cpus: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    memory_mb: Annotated[int, msgspec.Meta(gt=0, le=16 * 1024 * 1024)] = 256
    cpu_kind: Literal["shared", "performance"] = "shared"


class FlyRestart(Body):
    policy: Literal["no", "always", "on-failure"] = "on-failure"
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None


VolumeIdText = Annotated[str, msgspec.Meta(pattern=r"^vol_[0-9a-z]{16}$")]
SnapshotIdText = Annotated[str, msgspec.Meta(pattern=r"^vs_[0-9a-z]{16}$")]
MountPath = Annotated[str, msgspec.Meta(pattern=r"^/[^\x00]*$", max_length=4096)]


class FlyMount(Body):
    """A volume the machine mounts at `path` (it then runs on the volume's worker)."""

    volume: VolumeIdText
    path: MountPath
    name: str | None = None  # Fly's volume name; accepted, the id is what counts


class FlyMachineConfig(Body):
    image: str | None = None
    init: FlyInit = msgspec.field(default_factory=FlyInit)
    env: dict[EnvName, str] = {}
    guest: FlyGuest = msgspec.field(default_factory=FlyGuest)
    restart: FlyRestart = msgspec.field(default_factory=FlyRestart)
    metadata: dict[str, str] = {}
    auto_destroy: bool = False
    mounts: list[FlyMount] = []


class CreateMachineRequest(Body):
    config: FlyMachineConfig
    region: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # required: no "nearest region" here
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")] | None = None
    skip_launch: bool = False
    lease_ttl: int | None = None


class UpdateMachineRequest(Body):
    config: FlyMachineConfig
    region: str | None = None
    name: str | None = None
    skip_launch: bool = False


Duration = Annotated[str, msgspec.Meta(pattern=r"^\d{1,9}(\.\d{1,9})?(ms|s|m|h|d)$")]


# what the document offers for a signal: the host's signal names (the workers also take `TERM`, `term` and
# numbers, as flyctl may send them); a name outside the list is a 400 from the worker
SIGNAL_NAMES = sorted(s.name for s in signal.Signals)
SignalName = Annotated[str, msgspec.Meta(min_length=1, max_length=16, extra_json_schema={"enum": SIGNAL_NAMES})]


class StopRequest(Body):
    signal: SignalName = "SIGTERM"
    timeout: Annotated[float, msgspec.Meta(ge=0, le=86400)] | Duration = 10.0


class SignalRequest(Body):
    signal: SignalName


class LeaseRequest(Body):
    ttl: Annotated[int, msgspec.Meta(gt=0, le=86400)] = 30
    description: Annotated[str, msgspec.Meta(max_length=256)] = ""


class ErrorResponse(msgspec.Struct, kw_only=True):
    error: str
    status: Literal["unknown", "insufficient_capacity"] = "unknown"
    # extension: the machine a create (or start) made but could not start (a 422): it is kept, `failed`
    machine_id: str | msgspec.UnsetType = msgspec.UNSET


class FlyMachineEvent(msgspec.Struct, kw_only=True):
    type: str
    status: str
    source: str
    timestamp: int


class FlyMachine(msgspec.Struct, kw_only=True):
    id: str
    name: str
    state: State
    region: str
    instance_id: str
    config: FlyMachineConfig
    created_at: str
    updated_at: str
    events: list[FlyMachineEvent] = []
    # extensions (README "HTTP API"): where it runs, and how its process last ended
    worker_id: str = ""
    exit: dict[str, Any] | None = None


def command(init: FlyInit) -> list[str]:
    """The command `init` gives: `init.exec`, else `init.entrypoint` + `init.cmd` (empty: none given)."""
    return list(init.exec) if init.exec else [*(init.entrypoint or []), *(init.cmd or [])]


def to_config(config: FlyMachineConfig, *, image: str | None, cmd: list[str]) -> MachineConfig:
    """Fly's config as fauxmad's, with the image pinned (`image`: its digest, or None) and the command to run
    (`command(config.init)`, or the image's own when that is empty: `orchestrator.api.images`)."""
    return MachineConfig(
        image=image,
        cmd=cmd,
        env=config.env,
        guest=Guest(cpus=config.guest.cpus, memory_mb=config.guest.memory_mb, cpu_kind=config.guest.cpu_kind),
        restart=RestartPolicy(policy=config.restart.policy, max_retries=config.restart.max_retries),
        metadata=config.metadata,
        auto_destroy=config.auto_destroy,
        mounts=[Mount(volume=m.volume, path=m.path) for m in config.mounts],
    )


def from_config(config: MachineConfig) -> FlyMachineConfig:
    return FlyMachineConfig(
        image=config.image,
        init=FlyInit(cmd=list(config.cmd)),
        env=dict(config.env),
        guest=FlyGuest(cpus=config.guest.cpus, memory_mb=config.guest.memory_mb, cpu_kind=config.guest.cpu_kind),
        restart=FlyRestart(policy=config.restart.policy, max_retries=config.restart.max_retries),
        metadata=dict(config.metadata),
        auto_destroy=config.auto_destroy,
        mounts=[FlyMount(volume=m.volume, path=m.path) for m in config.mounts],
    )


def event(e: MachineEvent) -> FlyMachineEvent:
    return FlyMachineEvent(type=e.type, status=e.status, source=e.source, timestamp=int(e.timestamp * 1000))


def machine(m: Machine) -> FlyMachine:
    events = [event(e) for e in m.events] if isinstance(m.events, list) else []
    return FlyMachine(
        id=m.id,
        name=m.name,
        state=m.state,
        region=m.region,
        instance_id=m.instance_id,
        config=from_config(m.config),
        created_at=m.created_at,
        updated_at=m.updated_at,
        events=events,
        worker_id=m.worker_id,
        exit=msgspec.to_builtins(m.exit) if m.exit is not None else None,
    )


class CreateAppRequest(Body):
    app_name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    org_slug: str = "personal"
    network: str | None = None


class App(msgspec.Struct, kw_only=True):
    id: str
    name: str
    status: str
    machine_count: int = 0  # extension: machines the workers' last heartbeats count for it


class ListAppsResponse(msgspec.Struct, kw_only=True):
    total_apps: int
    apps: list[App]


class MetadataValue(Body):
    value: Annotated[str, msgspec.Meta(max_length=4096)]


class PlacementsRequest(Body):
    """A dry run: where `count` machines of `compute` would go. `region` is one region or several, comma-separated."""

    compute: FlyGuest = msgspec.field(default_factory=FlyGuest)
    count: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1
    region: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}(,[A-Za-z0-9_-]{1,64})*$")] | None = None
    org_slug: str = "personal"
    app: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")] = "placements"  # extension


class RegionPlacement(msgspec.Struct, kw_only=True):
    region: str
    count: int
    # extension: the brokers' dry run (`placements.simulate`): every worker's subscores and rejections
    explain: dict[str, Any] | None = None


class PlacementsResponse(msgspec.Struct, kw_only=True):
    regions: list[RegionPlacement]


# ---------------------------------------------------------------------------------------------------
# volumes (README "Volumes"): the response is the bus's `Volume`, whose fields are Fly's plus extensions


class CreateVolumeRequest(Body):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")]
    region: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    size_gb: Annotated[int, msgspec.Meta(ge=1, le=500)] = 1
    snapshot_id: SnapshotIdText | None = None  # restore that snapshot into the new volume (on any worker)
    # sent by Fly's clients; accepted and not acted on (README "Volumes": no encryption, no zones here)
    encrypted: bool = False
    fstype: Literal["ext4"] | None = None
    require_unique_zone: bool = False
    snapshot_retention: Annotated[int, msgspec.Meta(ge=1, le=60)] | None = None
    compute: FlyGuest | None = None
    machines_only: bool = False


class ExtendVolumeRequest(Body):
    size_gb: Annotated[int, msgspec.Meta(ge=1, le=500)]


class ExtendVolumeResponse(msgspec.Struct, kw_only=True):
    needs_restart: bool = False  # true: the kernel refused an online grow; it grows when its machine starts
    volume: Volume
