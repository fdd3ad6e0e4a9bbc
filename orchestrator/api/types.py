"""The HTTP request and response bodies, with Fly's field names, and their translation to the bus's types.

These Structs both validate requests (strict: an unknown field is a 400) and generate `/openapi.json`, so
the document cannot drift from what the server accepts.

A config comes back as it was sent, with the defaults filled in and none removed (a Fly client reads
`guest.cpus` whatever it sent): responses use the `...Out` Structs, which never omit a default, and what
fauxmad's own config cannot hold (the image reference as given where the machine keeps its digest, `init`'s
`exec`/`entrypoint` where it keeps one command, a mount's `name`) is kept in the machine's metadata label
`SENT_LABEL` and given back from there, as long as the config still matches it (see `sent_label`).
"""

from __future__ import annotations

import signal
from typing import Annotated, Any, Literal

import msgspec

from bus.contract.base import TOKEN_CHARS, Cpus, MemoryMb, Name, SnapshotId, State, Token, VolumeId
from bus.contract.codec import encode
from bus.contract.machines import Guest, Machine, MachineConfig, MachineEvent, Mount, MountPath, RestartPolicy
from bus.contract.volumes import SizeGb, Volume


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
    cpus: Cpus = 1
    memory_mb: MemoryMb = 256
    cpu_kind: Literal["shared", "performance"] = "shared"


class FlyRestart(Body):
    policy: Literal["no", "always", "on-failure"] = "on-failure"
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None


class FlyMount(Body):
    """A volume the machine mounts at `path` (it then runs on the volume's worker)."""

    volume: VolumeId
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
    region: Token  # required: no "nearest region" here
    name: Name | None = None
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


# ---------------------------------------------------------------------------------------------------
# responses: every default said, never dropped; UNSET only for what was never given (null is not Fly's)


class Out(msgspec.Struct, kw_only=True):
    """Base of a response's config parts: no `omit_defaults`, so `cpus: 1` comes back as `cpus: 1`."""


class FlyInitOut(Out):
    exec: list[str] | msgspec.UnsetType = msgspec.UNSET
    entrypoint: list[str] | msgspec.UnsetType = msgspec.UNSET
    cmd: list[str] | msgspec.UnsetType = msgspec.UNSET


class FlyGuestOut(Out):
    cpus: int
    memory_mb: int
    cpu_kind: str


class FlyRestartOut(Out):
    policy: str
    max_retries: int | msgspec.UnsetType = msgspec.UNSET


class FlyMountOut(Out):
    volume: str
    path: str
    name: str | msgspec.UnsetType = msgspec.UNSET


class FlyMachineConfigOut(Out):
    init: FlyInitOut
    env: dict[str, str]
    guest: FlyGuestOut
    restart: FlyRestartOut
    metadata: dict[str, str]
    auto_destroy: bool
    mounts: list[FlyMountOut]
    image: str | msgspec.UnsetType = msgspec.UNSET


class ImageRef(Out):
    """Fly's `image_ref`: what `config.image` resolved to (fauxmad's store has no registry)."""

    repository: str
    tag: str
    digest: str


# the label that keeps what a client sent and fauxmad's config cannot hold (module docstring)
SENT_LABEL = "fauxmad_fly_sent"


class Sent(msgspec.Struct, kw_only=True, omit_defaults=True):
    image: str | None = None  # the reference as given ...
    digest: str | None = None  # ... and the digest it was pinned to: given back only while the config has it
    init: FlyInit | None = None  # `exec` or `entrypoint` + `cmd` as given: given back while the command is theirs
    mount_names: dict[str, str] = {}  # volume id -> the `name` given with it


def sent_label(config: FlyMachineConfig, digest: str | None) -> str | None:
    """What `config` says that its fauxmad config will not: the value of `SENT_LABEL`, or None (nothing)."""
    sent = Sent(
        image=config.image if config.image and digest and config.image != digest else None,
        digest=digest if config.image and digest and config.image != digest else None,
        init=config.init if config.init.exec or config.init.entrypoint else None,
        mount_names={m.volume: m.name for m in config.mounts if m.name},
    )
    if sent.image is None and sent.init is None and not sent.mount_names:
        return None
    return encode(sent).decode()


def _sent(config: MachineConfig) -> Sent:
    raw = config.metadata.get(SENT_LABEL)
    if raw is None:
        return Sent()
    try:
        return msgspec.json.decode(raw, type=Sent)
    except msgspec.DecodeError:  # a label someone else wrote: ignored
        return Sent()


def visible_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """A machine's metadata without `SENT_LABEL` (it is the config's, said in the config's own fields)."""
    return {k: v for k, v in metadata.items() if k != SENT_LABEL}


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
    config: FlyMachineConfigOut | msgspec.UnsetType = msgspec.UNSET  # UNSET: a list's `summary=true`
    image_ref: ImageRef | msgspec.UnsetType = msgspec.UNSET
    created_at: str
    updated_at: str
    events: list[FlyMachineEvent] | msgspec.UnsetType = msgspec.UNSET
    # Fly's: where the machine is reached in the fleet, its worker's advertised address (its own host's; fauxmad
    # has no private network, so an edge on another host reaches it through that worker's backhaul); absent
    # for a machine whose worker advertises none (a worker older than the field)
    private_ip: str | msgspec.UnsetType = msgspec.UNSET
    # extensions (docs/reference/http-api.md): where it runs, and how its process last ended
    worker_id: str = ""
    exit: dict[str, Any] | None = None


def command(init: FlyInit) -> list[str]:
    """The command `init` gives: `init.exec`, else `init.entrypoint` + `init.cmd` (empty: none given)."""
    return list(init.exec) if init.exec else [*(init.entrypoint or []), *(init.cmd or [])]


def to_config(config: FlyMachineConfig, *, image: str | None, cmd: list[str]) -> MachineConfig:
    """Fly's config as fauxmad's, with the image pinned (`image`: its digest, or None) and the command to run
    (`command(config.init)`, or the image's own when that is empty: `orchestrator.api.images`); what the
    config cannot hold goes into the label `SENT_LABEL` (a label of that name sent by the client is replaced)."""
    metadata = visible_metadata(config.metadata)
    label = sent_label(config, image)
    if label is not None:
        metadata[SENT_LABEL] = label
    return MachineConfig(
        image=image,
        cmd=cmd,
        env=config.env,
        guest=Guest(cpus=config.guest.cpus, memory_mb=config.guest.memory_mb, cpu_kind=config.guest.cpu_kind),
        restart=RestartPolicy(policy=config.restart.policy, max_retries=config.restart.max_retries),
        metadata=metadata,
        auto_destroy=config.auto_destroy,
        mounts=[Mount(volume=m.volume, path=m.path) for m in config.mounts],
    )


def _init_out(init: FlyInit) -> FlyInitOut:
    unset = msgspec.UNSET
    return FlyInitOut(
        exec=list(init.exec) if init.exec else unset,
        entrypoint=list(init.entrypoint) if init.entrypoint is not None else unset,
        cmd=list(init.cmd) if init.cmd is not None else unset,
    )


def from_config(config: MachineConfig) -> FlyMachineConfigOut:
    """fauxmad's config as Fly's, every default said: what the client sent comes back (module docstring)."""
    sent = _sent(config)
    image: str | msgspec.UnsetType = msgspec.UNSET
    if config.image:
        image = sent.image if sent.image and sent.digest == config.image else config.image
    init = FlyInitOut(cmd=list(config.cmd))
    if sent.init is not None and command(sent.init) == list(config.cmd):
        init = _init_out(sent.init)
    guest = config.guest
    restart = config.restart
    return FlyMachineConfigOut(
        image=image,
        init=init,
        env=dict(config.env),
        guest=FlyGuestOut(cpus=guest.cpus, memory_mb=guest.memory_mb, cpu_kind=guest.cpu_kind),
        restart=FlyRestartOut(
            policy=restart.policy, max_retries=restart.max_retries if restart.max_retries is not None else msgspec.UNSET
        ),
        metadata=visible_metadata(config.metadata),
        auto_destroy=config.auto_destroy,
        mounts=[
            FlyMountOut(volume=m.volume, path=m.path, name=sent.mount_names.get(m.volume, msgspec.UNSET))
            for m in config.mounts
        ],
    )


def image_ref(config: MachineConfig) -> ImageRef | msgspec.UnsetType:
    """Fly's `image_ref` for a machine with an image: the reference it was given (or its digest) and its digest."""
    if not config.image:
        return msgspec.UNSET
    given = _sent(config)
    reference = given.image if given.image and given.digest == config.image else config.image
    if reference.startswith("sha256:"):
        return ImageRef(repository="", tag="", digest=config.image)
    repository, colon, tag = reference.rpartition(":")
    return ImageRef(repository=repository if colon else tag, tag=tag if colon else "", digest=config.image)


def event(e: MachineEvent) -> FlyMachineEvent:
    return FlyMachineEvent(type=e.type, status=e.status, source=e.source, timestamp=int(e.timestamp * 1000))


def machine(m: Machine, *, summary: bool = False) -> FlyMachine:
    """`m` as Fly's Machine; `summary` (a list's `?summary=true`): without its config and events."""
    if summary:
        return FlyMachine(
            id=m.id,
            name=m.name,
            state=m.state,
            region=m.region,
            instance_id=m.instance_id,
            created_at=m.created_at,
            updated_at=m.updated_at,
            worker_id=m.worker_id,
            private_ip=m.address or msgspec.UNSET,
        )
    events = [event(e) for e in m.events] if isinstance(m.events, list) else []
    return FlyMachine(
        id=m.id,
        name=m.name,
        state=m.state,
        region=m.region,
        instance_id=m.instance_id,
        config=from_config(m.config),
        image_ref=image_ref(m.config),
        created_at=m.created_at,
        updated_at=m.updated_at,
        events=events,
        private_ip=m.address or msgspec.UNSET,
        worker_id=m.worker_id,
        exit=msgspec.to_builtins(m.exit) if m.exit is not None else None,
    )


class CreateAppRequest(Body):
    app_name: Token
    org_slug: str = "personal"
    network: str | None = None


class Organization(msgspec.Struct, kw_only=True):
    name: str
    slug: str


class App(msgspec.Struct, kw_only=True):
    id: str
    name: str
    status: str  # "deployed": it has machines; "pending": none (yet)
    organization: Organization
    machine_count: int = 0  # extension: how many machines it has


class ListApp(msgspec.Struct, kw_only=True):
    id: str
    name: str
    machine_count: int  # machines the workers' last heartbeats count for it
    network: str = ""
    status: str = "pending"  # extension, as App's


class ListAppsResponse(msgspec.Struct, kw_only=True):
    total_apps: int
    apps: list[ListApp]


class AppRecord(msgspec.Struct, kw_only=True):
    """An app created by `POST /v1/apps`: key `<app>.record` of KV `fauxmad_apps` (`orchestrator.api.apps`)."""

    name: str
    org_slug: str = "personal"
    network: str = ""
    created_at: float = 0.0


class MetadataValue(Body):
    value: Annotated[str, msgspec.Meta(max_length=4096)]


class PlacementsRequest(Body):
    """A dry run: where `count` machines of `compute` would go. `region` is one region or several, comma-separated."""

    compute: FlyGuest = msgspec.field(default_factory=FlyGuest)
    count: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1
    region: Annotated[str, msgspec.Meta(pattern=rf"^{TOKEN_CHARS}(,{TOKEN_CHARS})*$")] | None = None  # a list of tokens
    org_slug: str = "personal"
    app: Token = "placements"  # extension


class RegionPlacement(msgspec.Struct, kw_only=True):
    region: str
    count: int
    # extension: the brokers' dry run (`placements.simulate`): every worker's subscores and rejections
    explain: dict[str, Any] | None = None


class PlacementsResponse(msgspec.Struct, kw_only=True):
    regions: list[RegionPlacement]


# ---------------------------------------------------------------------------------------------------
# volumes (docs/tutorials/images-and-volumes.md): the response is the bus's `Volume`, whose fields are Fly's plus
# extensions


class CreateVolumeRequest(Body):
    name: Name
    region: Token
    size_gb: SizeGb = 1
    snapshot_id: SnapshotId | None = None  # restore that snapshot into the new volume (on any worker)
    # sent by Fly's clients; accepted and not acted on (no encryption, no zones here:
    # docs/tutorials/images-and-volumes.md)
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
