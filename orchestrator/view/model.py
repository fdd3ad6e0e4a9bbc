"""What the systemwide view answers: frozen records, and the stable JSON shape of `fauxmad status --json`.

A `Snapshot` is one consistent read of the view at a moment (`taken_at`), made of plain records:
the CLI renders it as tables or as JSON, the live view lays it out, and tests compare it. Nothing
here touches SQLite or NATS.
"""

from __future__ import annotations

import msgspec

from bus.contract.offers import Resources

# worker status in the view: `ready` and `cordoned` are beating; `lost` stopped beating (its key
# expired or was deleted, or its last heartbeat is older than the registry's TTL)
READY, CORDONED, LOST = "ready", "cordoned", "lost"
HOST_OK, UNREACHABLE = "ok", "unreachable"  # a machine's host status (Fly's `host_status`)

# the machine label keys the deploy reconciler writes into `config.metadata`
RELEASE_KEY = "fauxmad_release"
ROLE_KEY = "fauxmad_role"

CHECK_RANK = {"passing": 0, "warning": 1, "critical": 2}


class Record(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the view's records: immutable, every field written."""


class WorkerRow(Record, frozen=True, kw_only=True):
    worker_id: str
    region: str
    status: str
    capacity: Resources
    used: Resources
    machines: int = 0
    cordoned: bool = False
    load: float = 0.0
    heartbeat_at: float | None = None  # epoch seconds of the last heartbeat the view saw
    states: dict[str, int] = {}
    address: str = ""  # where other hosts reach the worker (and its machines, through its backhaul)


class RegionRow(Record, frozen=True, kw_only=True):
    region: str
    workers: int  # beating (ready or cordoned)
    cordoned: int
    lost: int
    capacity: Resources
    used: Resources
    machines: int  # not destroyed, as the view knows them
    states: dict[str, int] = {}


class MachineRow(Record, frozen=True, kw_only=True):
    id: str
    app: str
    region: str
    worker_id: str
    state: str
    release: str | None = None
    role: str | None = None
    checks: dict[str, str] = {}  # the last known results (of a machine on an unreachable host, too)
    check_status: str = ""  # the worst of `checks`, "" when the machine has none
    exit_code: int | None = None
    version: int = 0  # the worker's log sequence of the last event the view applied
    updated_at: float = 0.0  # epoch milliseconds, as events carry them
    host_status: str = HOST_OK  # "ok" | "unreachable" (its worker's heartbeat expired: state and checks as last known)


class EventRow(Record, frozen=True, kw_only=True):
    stream_seq: int
    timestamp: float  # epoch milliseconds
    region: str
    worker_id: str
    app: str
    machine_id: str
    type: str
    status: str
    from_state: str | None = None
    reason: str | None = None


class MachineGroup(Record, frozen=True, kw_only=True):
    """How many machines of one app are in one state in one region, per role: the live view's unit."""

    region: str
    app: str
    state: str
    role: str
    count: int


class Snapshot(Record, frozen=True, kw_only=True):
    taken_at: float
    stream_seq: int
    apps: list[str]
    regions: list[RegionRow]
    workers: list[WorkerRow]
    machines: list[MachineRow]
    groups: list[MachineGroup]
    events: list[EventRow]  # the most recent, oldest first

    def status_json(self, view_path: str) -> dict[str, object]:
        """The documented shape of `fauxmad status --json`."""
        return {
            "regions": self.regions,
            "workers": self.workers,
            "machines": self.machines,
            "view": {"path": view_path, "stream_seq": self.stream_seq, "taken_at": self.taken_at},
        }


def worst_check(checks: dict[str, str]) -> str:
    if not checks:
        return ""
    return max(checks.values(), key=lambda status: CHECK_RANK.get(status, 1))


def role_of(metadata: dict[str, str]) -> str:
    return metadata.get(ROLE_KEY, "")
