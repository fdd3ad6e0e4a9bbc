"""Which committed records carry an audit record for the audit stream, and the id that deduplicates it (pure)."""

from __future__ import annotations

from bus.contract.machines import Guest, Machine, MachineConfig, MachineEvent
from bus.contract.streams import AuditRecord
from workers.audit_outbox import audit_msg_id, audits_of
from workers.log.records import MachineRecord, PendingAudit, StoredMachine

RECORD = AuditRecord(
    at=1.0, identity="nkey:UA", name="ci-web", method="NATS", path="fauxmad.v1.api.apps.web", status=200
)


def stored(events: list[MachineEvent]) -> StoredMachine:
    machine = Machine(
        id="0123456789abcd",
        name="m",
        app="web",
        region="mad",
        worker_id="w1",
        state="started",
        config=MachineConfig(cmd=["true"], guest=Guest(cpus=1, memory_mb=64)),
        instance_id="i",
        created_at="t",
        updated_at="t",
    )
    return StoredMachine(machine=machine, events=events)


def test_only_the_reserve_record_s_created_event_gives_its_audit_record_once() -> None:
    created = MachineEvent(status="created", seq=7, audit=RECORD)
    starting = MachineEvent(status="starting", seq=7)
    reserve = MachineRecord(seq=7, at=1.0, op="reserve", stored=stored([created, starting]))
    assert audits_of(reserve) == [PendingAudit(seq=7, app="web", machine_id="0123456789abcd", record=RECORD)]
    # a later record keeps the created event among its events: it is not sent again
    later = MachineRecord(
        seq=9, at=2.0, op="start", stored=stored([created, starting, MachineEvent(status="started", seq=9)])
    )
    assert audits_of(later) == []
    # a create not through the brokers (the HTTP API's, a reserve sent to the worker directly) carries none
    plain = MachineRecord(seq=3, at=1.0, op="reserve", stored=stored([MachineEvent(status="created", seq=3)]))
    assert audits_of(plain) == []


def test_the_record_s_id_is_the_same_on_every_retry_and_names_its_worker_machine_and_reserve() -> None:
    pending = PendingAudit(seq=7, app="web", machine_id="0123456789abcd", record=RECORD)
    assert audit_msg_id("w1", pending) == audit_msg_id("w1", pending) == "w1:0123456789abcd:7:audit"
