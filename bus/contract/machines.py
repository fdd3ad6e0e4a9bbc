"""Machines: the config a machine runs, the machine and its events as workers report them, the verbs of
`fauxmad.v1.worker.<id>.machines.<verb>`, and the routing index's entry (KV `fauxmad_machines`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from bus.contract.base import (
    SECONDS_MAX,
    Cpus,
    MachineId,
    MemoryMb,
    Name,
    Reply,
    Request,
    Seconds,
    State,
    Token,
    VolumeId,
    seconds,
)
from bus.contract.errors import BadRequest
from bus.contract.streams import AuditRecord

Sandbox = Literal["none", "bwrap"]


class Guest(Request):
    cpus: Cpus = 1
    memory_mb: MemoryMb = 256
    cpu_kind: Literal["shared", "performance"] = "shared"
    # addition: "bwrap" runs the machine in its own pid, mount, ipc and uts namespaces
    # (docs/tutorials/images-and-volumes.md)
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


class Service(Request):
    """A port the machine serves that the edge may reach (Fly's `services[].internal_port`): an app whose
    `[http_service]` names an `internal_port` listens there, not on its `PORT`, and a worker's backhaul reaches
    only the ports a machine's config names (docs/tutorials/edge.md)."""

    internal_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]


MountPath = Annotated[str, msgspec.Meta(pattern=r"^/[^\x00]*$", max_length=4096)]  # absolute; the API's too


class Mount(Request):
    """A volume the machine mounts (docs/tutorials/images-and-volumes.md): it runs on the volume's worker, the volume at
    `path`."""

    volume: VolumeId
    path: MountPath


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
    services: list[Service] = []  # addition: ports the edge may reach besides `PORT` (Fly's services)
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

    def require_command(self) -> None:
        """A config may leave `cmd` out where an image's manifest gives one; what is run must have one."""
        if not self.cmd:
            raise BadRequest("config.cmd is required: the process driver needs a command to run")


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
    # additions (documented in docs/reference/nats-contract.md): the config's labels where a config is (re)written
    # (`reserve`, `update`), so the systemwide view knows a machine's release and role; and the
    # check that changed, on `check` events
    metadata: dict[str, str] | None = None
    # addition: the instance the machine ran (or will run) when the event happened: checks belong to an
    # instance, so a reader keeps them across an `update` that kept the instance (a relabel in place)
    instance_id: str | None = None
    # addition: on the `created` event of a reserve, why the broker chose this worker (its short explain)
    placement: dict[str, Any] | None = None
    check: CheckStatus | None = None
    # addition: on the `created` event of a reserve made for a create through the brokers, the create's audit
    # record (who signed it, the subject, status 200): the event is the create's one durable write on the bus,
    # and the audit trail of a create is this event (docs/explanation/architecture.md#one-durable-write-per-create)
    audit: AuditRecord | None = None


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
    # additions to the Fly field set (documented in docs/reference/nats-contract.md)
    port: int | None = None
    checks: dict[str, CheckStatus] = {}
    exit: ExitInfo | None = None
    restarts: int = 0
    version: int = 0
    lease: Lease | None = None
    explain: Any | msgspec.UnsetType = msgspec.UNSET
    # addition: the address other hosts reach its worker at (`fauxmad worker --advertise`); the machine itself
    # listens on its host's loopback only, and an edge on another host reaches it through that worker's backhaul
    address: str | None = None


class Lease(Reply):
    nonce: str
    holder: str = ""
    expires_at: float = 0.0


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
    # addition: the create's audit record, kept in the machine's `created` event (`MachineEvent.audit`)
    audit: AuditRecord | None = None


class IdRequest(Request):
    id: MachineId
    lease_nonce: str | None = None


class StartRequest(IdRequest):
    pass


STOP_TIMEOUT_MAX = SECONDS_MAX  # what a worker's stop waits at most: the HTTP API and the CLI cap it here


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
    ttl: Annotated[float, msgspec.Meta(gt=0, le=SECONDS_MAX)] = 30.0
    holder: Annotated[str, msgspec.Meta(max_length=256)] = ""
    nonce: str | None = None


class ReleaseRequest(Request):
    id: MachineId
    nonce: str


class ListRequest(Request):
    app: Token | None = None
    state: State | None = None
    include_destroyed: bool = False
    # through the brokers (`api.apps.<app>.machines.list`): only this worker's machines of the app, and its silence
    # is an error rather than an empty list (a reconciler acting for a deployer observes each worker this way)
    worker_id: Token | None = None


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
    address: str | None = None  # addition: its worker's advertised address (None: a worker older than that)


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
        address=machine.address,
    )


# addition: a cordoned machine (Fly's machine cordon) carries this label in `config.metadata`; edge proxies
# route no request to it and neither start nor stop it. Set in place, like any label (no restart).
CORDONED_LABEL = "fauxmad_cordoned"
# A machine that runs one attempt of a background job (the `machine` runner) carries the job's id under this label in
# `config.metadata`. It is the job's, not one of its app's: reconcilers do not count it among the app's machines
# (an operator took one for a primary too many and destroyed it, every attempt), and edge proxies route no request
# to it and neither start nor stop it.
JOB_LABEL = "fauxmad_job"
