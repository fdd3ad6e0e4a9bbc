"""The message types of the bus contract, as msgspec Structs.

Requests are strict (`forbid_unknown_fields`): a misspelt field is a 400 naming it rather than a
silently ignored option. Replies are lenient, so a newer worker or broker can add fields without
breaking older callers. Field names follow the Fly Machines API where one exists. Every addition to
the contract in DESIGN.md is listed in the README.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

MACHINE_ID = re.compile(r"^[0-9a-f]{14}$")
NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"

Token = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
MachineId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{14}$")]
Name = Annotated[str, msgspec.Meta(pattern=NAME)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=86400)]

State = Literal[
    "created",
    "starting",
    "started",
    "stopping",
    "stopped",
    "destroying",
    "destroyed",
    "failed",
    "replacing",
    "suspending",  # addition: the process is being frozen (SIGSTOP of its process group)
    "suspended",  # addition: frozen; memory kept, no CPU; `resume` continues it where it was
]


class Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of everything a caller sends: unknown fields are an error."""


class Reply(msgspec.Struct, kw_only=True):
    """Base of everything a service answers: unknown fields are ignored (forward compatible).

    Every field is written, defaults included, so callers in any language see the whole record;
    fields that exist only on some answers (`events` on get) are `UNSET` and then left out.
    """


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: float | str) -> float:
    """A duration as seconds: a number, or a string such as `500ms`, `10s`, `2m` (Fly's style)."""
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"negative duration {value}")
        return float(value)
    match = _DURATION.match(value.strip())
    if not match:
        raise ValueError(f"invalid duration {value!r}: use seconds or a string like '10s' or '500ms'")
    return float(match.group(1)) * _UNIT[match.group(2)]


# ---------------------------------------------------------------------------------------------------
# Machine configuration (contract)


Sandbox = Literal["none", "bwrap"]


class Guest(Request):
    cpus: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    memory_mb: Annotated[int, msgspec.Meta(gt=0, le=16 * 1024 * 1024)] = 256
    cpu_kind: Literal["shared", "performance"] = "shared"
    # addition: "bwrap" runs the machine in its own pid, mount, ipc and uts namespaces (README "Sandboxes")
    sandbox: Sandbox = "none"


class RestartPolicy(Request):
    policy: Literal["no", "always", "on-failure"] = "on-failure"
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None


class Check(Request):
    type: Literal["tcp", "http", "cmd"]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    path: str = "/"
    command: list[str] | None = None
    interval: float | str = 10.0
    timeout: float | str = 2.0
    grace_period: float | str = 0.0

    def __post_init__(self) -> None:
        for field in ("interval", "timeout", "grace_period"):
            try:
                seconds(getattr(self, field))
            except ValueError as exc:
                raise ValueError(f"check {field}: {exc}") from None
        if self.type == "cmd" and not self.command:
            raise ValueError("a cmd check needs a non-empty `command`")
        if seconds(self.interval) < 0.05:
            raise ValueError("check interval must be at least 50ms")


class Mount(Request):
    """A volume the machine mounts (README "Volumes"): it runs on the volume's worker, the volume at `path`."""

    volume: Annotated[str, msgspec.Meta(pattern=r"^vol_[0-9a-z]{16}$")]
    path: Annotated[str, msgspec.Meta(pattern=r"^/[^\0]*$", max_length=4096)]


class MachineConfig(Request):
    image: str | None = None
    cmd: list[str] = []
    env: dict[str, str] = {}
    guest: Guest = msgspec.field(default_factory=Guest)
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)
    checks: dict[str, Check] = {}
    metadata: dict[str, str] = {}
    standbys: list[MachineId] = []
    auto_destroy: bool = False
    mounts: list[Mount] = []
    # addition: the directory `cmd` runs in, absolute, on the worker's host (default: the machine's own)
    workdir: Annotated[str, msgspec.Meta(max_length=4096)] | None = None

    def __post_init__(self) -> None:
        for key in self.env:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"invalid env var name {key!r}")
        if any("\0" in part for part in self.cmd):
            raise ValueError("cmd must not contain NUL bytes")
        if self.workdir is not None and (not self.workdir.startswith("/") or "\0" in self.workdir):
            raise ValueError("workdir must be an absolute path")
        if len({mount.volume for mount in self.mounts}) != len(self.mounts):
            raise ValueError("mounts: a volume can be mounted once")


# ---------------------------------------------------------------------------------------------------
# Machines (contract)


class ExitInfo(Reply):
    """How a machine's process last ended."""

    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    requested_stop: bool = False
    lost: bool = False
    at: float = 0.0
    # addition: the last lines the process wrote to stderr before it ended (at most 20, each clipped)
    stderr_tail: list[str] = []


class CheckStatus(Reply):
    name: str
    status: Literal["passing", "warning", "critical"] = "warning"
    output: str = ""
    updated_at: float = 0.0


class MachineEvent(Reply):
    """One state transition (or exit, or check change) of one machine, as published on the events subject."""

    type: Literal["transition", "exit", "check", "restart", "update", "lease"] = "transition"
    status: str = ""
    from_state: str | None = None
    source: Literal["user", "worker"] = "worker"
    reason: str | None = None
    exit: ExitInfo | None = None
    timestamp: float = 0.0
    seq: int = 0
    machine_id: str = ""
    app: str = ""
    region: str = ""
    worker_id: str = ""
    # additions (documented in the README): the config's labels where a config is (re)written
    # (`reserve`, `update`), so the systemwide view knows a machine's release and role; and the
    # check that changed, on `check` events
    metadata: dict[str, str] | None = None
    # addition: the instance the machine ran (or will run) when the event happened: checks belong to an
    # instance, so a reader keeps them across an `update` that kept the instance (a relabel in place)
    instance_id: str | None = None
    # addition: on the `created` event of a reserve, why the broker chose this worker (its short explain)
    placement: dict[str, Any] | None = None
    check: CheckStatus | None = None


class Machine(Reply):
    id: str
    name: str
    app: str
    region: str
    worker_id: str
    state: State
    config: MachineConfig
    instance_id: str
    created_at: str
    updated_at: str
    events: list[MachineEvent] | msgspec.UnsetType = msgspec.UNSET
    # additions to the Fly field set (documented in the README)
    port: int | None = None
    checks: dict[str, CheckStatus] = {}
    exit: ExitInfo | None = None
    restarts: int = 0
    version: int = 0
    lease: Lease | None = None
    explain: Any | msgspec.UnsetType = msgspec.UNSET


class Lease(Reply):
    nonce: str
    holder: str = ""
    expires_at: float = 0.0


# ---------------------------------------------------------------------------------------------------
# Offers (contract)


class Resources(Reply):
    cpus: int = 0
    memory_mb: int = 0


class OfferGuest(Request):
    cpus: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    memory_mb: Annotated[int, msgspec.Meta(gt=0, le=16 * 1024 * 1024)] = 256
    cpu_kind: Literal["shared", "performance"] = "shared"
    sandbox: Sandbox = "none"  # addition


class OfferRequest(Request):
    app: Token
    region: Token
    guest: OfferGuest = msgspec.field(default_factory=OfferGuest)
    image: str | None = None
    request_id: str | None = None


class Offer(Reply, tag="offer", tag_field="type"):
    worker_id: str
    region: str
    capacity: Resources
    free: Resources
    image_cached: bool = False
    machines: int = 0
    load: float = 0.0
    app_machines: int = 0
    sandboxes: list[str] = []  # addition: the sandboxes this worker can run besides "none" (e.g. ["bwrap"])


class Decline(Reply, tag="decline", tag_field="type"):
    worker_id: str
    reason: str
    region: str = ""
    free: Resources | None = None


OfferReply = Offer | Decline


# ---------------------------------------------------------------------------------------------------
# Workers (contract)


class WorkerInfo(Reply):
    worker_id: str
    region: str
    capacity: Resources
    used: Resources
    machines: int = 0
    cordoned: bool = False
    images: list[str] = []
    load: float = 0.0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    states: dict[str, int] = {}
    limits: str = ""
    pid: int = 0
    log_seq: int = 0
    # addition: machines per app (what an offer's app_machines says), for placement from the replica
    app_machines: dict[str, int] = {}
    sandboxes: list[str] = []  # addition: as an offer's
    # additions (README "Volumes"): the volumes' sizes it may hold, and holds
    volume_capacity_gb: int = 0
    volume_used_gb: int = 0


# ---------------------------------------------------------------------------------------------------
# Worker machine verbs (contract)


class ReserveRequest(Request):
    app: Token
    region: Token
    config: MachineConfig
    name: Name | None = None
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    id: MachineId | None = None
    # addition: start it too, in the same request (one leg): the reservation commit records `starting`, the
    # worker launches the process and answers once `started` is committed (or `failed`, with the reason)
    launch: bool = False
    # addition: epoch seconds after which the worker must not commit this reserve (504, nothing reserved)
    expires_at: float | None = None
    # addition: why the broker chose this worker (a short explain), kept in the machine's `created` event
    placement: dict[str, Any] | None = None


class IdRequest(Request):
    id: MachineId
    lease_nonce: str | None = None


class StartRequest(IdRequest):
    pass


class StopRequest(IdRequest):
    signal: str = "SIGTERM"
    timeout: Seconds = 10.0


class DestroyRequest(IdRequest):
    force: bool = False


class SuspendRequest(IdRequest):
    """Addition: freeze a started machine's process group (SIGSTOP); it keeps its memory and reservation."""


class ResumeRequest(IdRequest):
    """Addition: continue a suspended machine (SIGCONT): back to `started` in a millisecond or so."""


class GetRequest(Request):
    id: MachineId
    events: bool = True


class WaitRequest(Request):
    id: MachineId
    state: State = "started"
    timeout: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 60.0


class SignalRequest(Request):
    id: MachineId
    signal: str
    lease_nonce: str | None = None


class LeaseRequest(Request):
    id: MachineId
    ttl: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    holder: Annotated[str, msgspec.Meta(max_length=256)] = ""
    nonce: str | None = None


class ReleaseRequest(Request):
    id: MachineId
    nonce: str


class ListRequest(Request):
    app: Token | None = None
    state: State | None = None
    include_destroyed: bool = False


class UpdateRequest(Request):
    """Replace a machine's config (a new `instance_id`); a running machine is restarted with it."""

    id: MachineId
    config: MachineConfig
    lease_nonce: str | None = None
    timeout: Seconds = 10.0


# addition: run a command in a started machine's environment, working directory and limits
EXEC_MAX_OUTPUT = 32 * 1024  # bytes of stdout and of stderr kept (each); the rest is read and dropped


class ExecRequest(Request):
    id: MachineId
    cmd: Annotated[list[str], msgspec.Meta(min_length=1, max_length=4096)]
    timeout: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0

    def __post_init__(self) -> None:
        if any("\0" in part for part in self.cmd):
            raise ValueError("cmd must not contain NUL bytes")
        if not self.cmd[0]:
            raise ValueError("cmd[0] must not be empty")


class ExecReply(Reply):
    """How an `exec` ended: `exit_code` (None when killed by a signal or the timeout), its output (each
    stream at most `EXEC_MAX_OUTPUT` bytes, decoded as UTF-8 with replacement; `truncated` says if any was cut)."""

    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False


# ---------------------------------------------------------------------------------------------------
# Broker API (contract)


# How a broker finds candidates: ask the region (`scatter`), ask two sampled workers (`p2c`), `scatter` and
# reserve on the best two at once (`hedged`), or ask nobody and rank the workers' heartbeats (`replica`,
# an addition). The broker's own strategy is the default.
Strategy = Literal["scatter", "p2c", "hedged", "replica"]
# An app's placement policy, `[placement] preset` in fauxmad.toml (see the README for the curves).
Preset = Literal["balanced", "binpack", "spread"]


class CreateRequest(Request):
    region: Token
    config: MachineConfig
    name: Name | None = None
    skip_launch: bool = False
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    explain: bool = False
    strategy: Strategy | None = None
    # addition: workers that must not get this machine (a spare away from its primary, a drained host)
    avoid_workers: list[Token] = []
    # addition: workers it should get only if no other has room (a penalty in the ranking, not a filter)
    prefer_away: list[Token] = []
    # addition: the app's placement policy, `[placement] preset` in fauxmad.toml (None: the broker's curves)
    placement_preset: Preset | None = None


class SimulateRequest(Request):
    """A dry-run placement: which worker would win, and why. Nothing is reserved."""

    app: Token
    region: Token
    guest: OfferGuest = msgspec.field(default_factory=OfferGuest)
    image: str | None = None
    strategy: Strategy | None = None
    placement_preset: Preset | None = None


class WorkersListRequest(Request):
    region: Token | None = None


class RegionSummary(Reply):
    region: str
    workers: int
    cordoned: int
    capacity: Resources
    used: Resources
    machines: int
    # in a supercluster: False when the region's cluster does not answer (cut off, or down: from outside the two
    # look the same, so nothing of it is moved); an addition to the contract, absent (true) on one server
    reachable: bool = True


class InfoRequest(Request):
    """`info` takes no fields: an empty payload or `{}`."""


class RegionsListRequest(Request):
    """`regions.list` takes no fields: an empty payload or `{}` (anything else is a 400, not ignored)."""


class CordonRequest(Request):
    reason: str = ""


class MachineIndexEntry(Reply):
    """A value of KV `fauxmad_machines`: where a machine lives, for routing by id."""

    id: str
    worker_id: str
    region: str
    app: str
    state: str
    name: str = ""
    version: int = 0
    # addition: the machine's config.metadata, so a reconciler knows the role of a machine on a lost worker
    metadata: dict[str, str] = {}
    port: int | None = None  # addition: the machine's PORT, so the edge proxy can reach it


def index_entry(machine: Machine) -> MachineIndexEntry:
    """A machine's routing index entry: what its worker writes, and what a broker or proxy that has just
    placed or started it remembers until the index's watch catches up."""
    return MachineIndexEntry(
        id=machine.id,
        worker_id=machine.worker_id,
        region=machine.region,
        app=machine.app,
        state=machine.state,
        name=machine.name,
        version=machine.version,
        metadata=dict(machine.config.metadata),
        port=machine.port,
    )


# addition: a cordoned machine (Fly's machine cordon) carries this label in `config.metadata`; edge proxies
# route no request to it and neither start nor stop it. Set in place, like any label (no restart).
CORDONED_LABEL = "fauxmad_cordoned"


# ---------------------------------------------------------------------------------------------------
# Edge proxy signals (addition)


class ProxyActivity(Reply):
    """`fauxmad.v1.proxy.activity.<app>`: the machines one edge proxy served (or holds a request on) since its
    last report, sent once an autostop round (every second) when there are any. Every proxy counts them as
    used, so a machine busy only through another proxy is not stopped as idle."""

    proxy: str  # the sender's id, so it skips its own reports
    app: str
    machines: list[str]


class ProxyUnreachable(Reply):
    """`fauxmad.v1.proxy.unreachable.<app>.<machine_id>`: a machine refused or dropped a proxy's connection.

    A hint, not a verdict: anyone who can publish there can send one, so a reconciler asks the worker itself
    before it acts on it."""

    app: str
    machine_id: str
    worker_id: str
    region: str
    proxy_region: str = ""
    error: str = ""
    at: float = 0.0


# ---------------------------------------------------------------------------------------------------
# Audit (addition)


class AuditRecord(Reply):
    """Stream `FAUXMAD_AUDIT`, subject `fauxmad.v1.audit.<app>`: one mutating API request, over HTTP (`method`
    is the HTTP method, `path` the URL path) or over NATS (`method` "NATS", `path` the subject)."""

    at: float
    # HTTP: "token:<id>" (caveats in `scope`), "static-token", "anonymous" (open API), "refused";
    # NATS: "nkey:<public key>" (a signed request, `bus.transport.audit`), "unsigned"
    identity: str
    method: str
    path: str
    status: int
    scope: list[str] = []
    app: str = ""
    remote: str = ""
    request_id: str = ""
    name: str = ""  # NATS: the name the signing identity gives itself (its credentials' name)


# ---------------------------------------------------------------------------------------------------
# Logs (contract)


class LogLine(Reply):
    machine_id: str
    app: str
    stream: Literal["stdout", "stderr"]
    line: str
    timestamp: float
    region: str = ""
    worker_id: str = ""


# ---------------------------------------------------------------------------------------------------
# Errors (contract)


class ErrorDetail(Reply):
    code: int
    message: str


class ErrorBody(Reply):
    error: ErrorDetail


class Ack(Reply):
    ok: bool = True
    message: str = ""


# ---------------------------------------------------------------------------------------------------
# The verbs of each subject family, listed once (contract): what each verb's payload is. Subjects, the worker's
# dispatch, the broker's forwarding and the fuzz tests all read these two tables.

# `fauxmad.v1.worker.<id>.machines.<verb>`: the worker decodes each payload with its type.
WORKER_REQUESTS: dict[str, type[Request]] = {
    "reserve": ReserveRequest,
    "start": StartRequest,
    "stop": StopRequest,
    "destroy": DestroyRequest,
    "get": GetRequest,
    "list": ListRequest,
    "wait": WaitRequest,
    "signal": SignalRequest,
    "lease": LeaseRequest,
    "release": ReleaseRequest,
    "update": UpdateRequest,
    "exec": ExecRequest,
    "suspend": SuspendRequest,
    "resume": ResumeRequest,
}
# `fauxmad.v1.api.apps.<app>.machines.<verb>`: `create` and `list` are the broker's own; every other verb is
# forwarded to the machine's worker, which takes the same payload (a reserve is the broker's to send).
BROKER_REQUESTS: dict[str, type[Request]] = {"create": CreateRequest, "list": ListRequest}
API_REQUESTS: dict[str, type[Request]] = BROKER_REQUESTS | {
    verb: kind for verb, kind in WORKER_REQUESTS.items() if verb not in BROKER_REQUESTS and verb != "reserve"
}
# payloads that may be empty (`{}` assumed)
EMPTY_OK: frozenset[type[Request]] = frozenset({ListRequest})


# ---------------------------------------------------------------------------------------------------
# Volumes (addition; README "Volumes"): flyd's other state machine, Fly's field names. A volume lives on one
# worker (its data is there), and a machine that mounts it can only be placed on that worker.

VolumeId = Annotated[str, msgspec.Meta(pattern=r"^vol_[0-9a-z]{16}$")]
SnapshotId = Annotated[str, msgspec.Meta(pattern=r"^vs_[0-9a-z]{16}$")]
SizeGb = Annotated[int, msgspec.Meta(ge=1, le=500)]  # Fly's largest volume
VolumeState = Literal["creating", "created", "attached", "destroying", "destroyed"]


class Volume(Reply):
    id: str
    name: str
    app: str
    region: str
    zone: str  # Fly's zone is the host's; here the worker's id (a volume never leaves its worker)
    state: VolumeState
    size_gb: int
    attached_machine_id: str | None = None
    attached_alloc_id: str | None = None  # the attached machine's instance id
    created_at: str = ""
    encrypted: bool = False
    fstype: str = "ext4"
    block_size: int = 0
    blocks: int = 0
    blocks_avail: int = 0
    blocks_free: int = 0
    snapshot_retention: int = 5
    auto_backup_enabled: bool = False
    # additions
    worker_id: str = ""
    updated_at: str = ""
    size_limit: str = ""  # how the size is enforced on this worker: "loop" (an ext4 image) or "none"
    snapshot_id: str | None = None  # the snapshot it was restored from
    version: int = 0  # the worker's log sequence of the last change


class VolumeSnapshot(Reply):
    id: str
    volume_id: str
    app: str
    created_at: str
    digest: str  # sha256:<hex> of the archive
    size: int  # bytes of the archive in the object store
    status: str = "created"
    region: str = ""
    worker_id: str = ""  # where it was taken


class VolumeIndexEntry(Reply):
    """A value of KV `fauxmad_volumes` (key: the volume id): where a volume lives, for routing by id."""

    id: str
    app: str
    name: str
    region: str
    worker_id: str  # a volume never moves: this is written once, by the broker that created it


class VolumeCreateRequest(Request):
    """Create a volume on this worker (`worker.<id>.volumes.create`), empty or restored from a snapshot."""

    app: Token
    region: Token
    name: Name
    size_gb: SizeGb = 1
    id: VolumeId | None = None  # the broker's choice, so a re-sent create names the same volume
    snapshot_id: SnapshotId | None = None


class VolumeIdRequest(Request):
    id: VolumeId


class VolumeExtendRequest(Request):
    id: VolumeId
    size_gb: SizeGb


class VolumeListRequest(Request):
    app: Token | None = None
    include_destroyed: bool = False


class VolumeApiCreateRequest(Request):
    """`api.apps.<app>.volumes.create`: the brokers pick a worker of the region with room for it."""

    region: Token
    name: Name
    size_gb: SizeGb = 1
    snapshot_id: SnapshotId | None = None


class VolumeApiListRequest(Request):
    include_destroyed: bool = False


# `fauxmad.v1.worker.<id>.volumes.<verb>`
WORKER_VOLUME_REQUESTS: dict[str, type[Request]] = {
    "create": VolumeCreateRequest,
    "list": VolumeListRequest,
    "get": VolumeIdRequest,
    "extend": VolumeExtendRequest,
    "destroy": VolumeIdRequest,
    "snapshot": VolumeIdRequest,
}
# `fauxmad.v1.api.apps.<app>.volumes.<verb>`: `create`, `list` and `snapshots` (a volume's snapshots, from the
# object store) are the brokers' own; the others are forwarded to the volume's worker with the same payload
API_VOLUME_REQUESTS: dict[str, type[Request]] = {
    "create": VolumeApiCreateRequest,
    "list": VolumeApiListRequest,
    "snapshots": VolumeIdRequest,
    "get": VolumeIdRequest,
    "extend": VolumeExtendRequest,
    "destroy": VolumeIdRequest,
    "snapshot": VolumeIdRequest,
}
VOLUME_EMPTY_OK: frozenset[type[Request]] = frozenset({VolumeListRequest, VolumeApiListRequest})
