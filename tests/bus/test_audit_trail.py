"""The audit trail's records and their acks on a real nats-server: every record stored, `drain` waits for all of
them, and a record nothing stores is logged as not acknowledged (the request it records still succeeds)."""

from __future__ import annotations

import asyncio
import logging
import time

import nats
import pytest

from bus.contract import subjects
from bus.contract.streams import AuditRecord
from bus.local.embedded import EmbeddedNats
from bus.transport.audit import AuditTrail
from bus.transport.jetstream import ensure_audit_stream
from tests.helpers import arun


def record(n: int) -> AuditRecord:
    return AuditRecord(at=time.time(), identity="unsigned", method="NATS", path=f"test.{n}", status=200, app="web")


def test_every_record_is_stored_and_drain_waits_for_the_acks(fresh_nats: EmbeddedNats) -> None:
    async def main() -> None:
        nc = await nats.connect(fresh_nats.url)
        js = nc.jetstream()
        await ensure_audit_stream(js)
        trail = AuditTrail(nc)
        for n in range(300):
            await trail.record(subjects.audit("web"), record(n))
        await trail.drain(timeout=10)
        assert trail.pending == 0
        info = await js.stream_info(subjects.AUDIT_STREAM)
        assert info.state.messages == 300
        await nc.close()

    arun(main())


def test_a_record_no_stream_takes_is_logged(fresh_nats: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        nc = await nats.connect(fresh_nats.url)
        trail = AuditTrail(nc)  # no audit stream on this server
        with caplog.at_level(logging.ERROR, logger="bus.transport.audit"):
            await trail.record(subjects.audit("web"), record(1))
            deadline = time.monotonic() + 10
            while trail.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        assert trail.pending == 0
        assert any("NATS test.1 by unsigned was not acknowledged" in r.getMessage() for r in caplog.records)
        await nc.close()

    arun(main())
