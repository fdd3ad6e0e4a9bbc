"""What the worker keeps in LMDB: the stored machine, worker state, and the op-log record kinds.

The op log is a tagged union with one decoder. Each record carries the full new value of what it
changed (a machine, the worker's cordon flag), so replaying the log is "last write per key wins":
simple to get right, and compaction can drop any record a later one supersedes without changing
what a replay produces.
"""

from __future__ import annotations

import msgspec

from bus.contract.machines import Machine, MachineEvent
from bus.contract.offers import Resources
from bus.contract.streams import AuditRecord
from bus.contract.volumes import Volume
from workers.driver.base import TaskHandle

EVENTS_KEPT = 20


def newest_events(events: list[MachineEvent], keep: int = EVENTS_KEPT) -> list[MachineEvent]:
    """The newest `keep` events at most, whole records only: a record cut in two (an exit kept without the
    state it settled in) would leave its second half numbered as if it were all of it (`Nats-Msg-Id`'s n)."""
    start = len(events) - keep
    if start <= 0:
        return events
    first = events[start].seq
    if first != 0 and events[start - 1].seq == first:
        while start < len(events) and events[start].seq == first:
            start += 1
    return events[start:]


class StoredMachine(msgspec.Struct, kw_only=True):
    """A machine as the worker keeps it: the API view plus what only the worker needs."""

    machine: Machine
    handle: TaskHandle | None = None
    idempotency_key: str | None = None
    restart_attempts: int = 0
    desired: str = "created"
    stop_signal: str = "SIGTERM"
    events: list[MachineEvent] = []


class PendingAudit(msgspec.Struct, kw_only=True, frozen=True):
    """A create's audit record that the worker committed and the audit stream has not acknowledged yet (table
    `audit`, keyed by the reserve's log sequence: `workers.audit_outbox`). Delivery state, not the machine's: no
    log record, and `rebuild` does not derive it."""

    seq: int  # the reserve's log record (its `created` event carries the same record)
    app: str
    machine_id: str
    record: AuditRecord


class WorkerState(msgspec.Struct, kw_only=True):
    cordoned: bool = False
    reason: str = ""
    seq: int = 0


class Usage(msgspec.Struct, kw_only=True):
    """Resources held by machines that are not destroyed: derived, kept in the same transaction."""

    cpus: int = 0
    memory_mb: int = 0
    machines: int = 0

    def resources(self) -> Resources:
        return Resources(cpus=self.cpus, memory_mb=self.memory_mb)


class MachineRecord(msgspec.Struct, tag="machine", kw_only=True):
    seq: int
    at: float
    op: str
    stored: StoredMachine


class WorkerRecord(msgspec.Struct, tag="worker", kw_only=True):
    seq: int
    at: float
    op: str
    state: WorkerState


class ImageRecord(msgspec.Struct, tag="image", kw_only=True):
    seq: int
    at: float
    op: str
    image: str


class VolumeRecord(msgspec.Struct, tag="volume", kw_only=True):
    """A volume's new value (docs/tutorials/images-and-volumes.md): created, attached, detached, extended, destroyed."""

    seq: int
    at: float
    op: str
    volume: Volume


LogRecord = MachineRecord | WorkerRecord | ImageRecord | VolumeRecord
