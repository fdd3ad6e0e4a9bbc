"""The creates' audit records, from the worker's LMDB to the audit stream, in the background.

A create through the brokers carries its audit record (who signed it, its subject, 200) in the reserve; the worker
keeps it in the machine's `created` event and, in the same commit, in its table `audit` (`Tx.keep_audit`). The
reply waits for neither copy on the bus. The event goes with the others (`workers.outbox`) to the events stream,
which keeps events 7 days; this lane sends the record to `FAUXMAD_AUDIT` on `fauxmad.v1.audit.<app>`, kept 90
days like every other audit record, so the audit trail is one stream again
(docs/explanation/architecture.md#one-durable-write-per-create).

- Why not nats-server's own copy (the audit stream sourcing the events stream): a source selects by subject only,
  and an audited `created` event has its machine's subject, as every other event of it does (the contract's
  `fauxmad.v1.events.<region>.<worker_id>.<app>.<machine_id>`). Why not per-message TTLs keeping audited events
  90 days in the events stream: the trail would stay split in two streams, and the events stream's byte limit
  (discard old) drops its oldest messages first, which would be the creates' records.
- Nothing acknowledged is lost: a row leaves the table only after the audit stream has acked its record
  (`Store.audits_delivered`, deleted by the next commit); after a `kill -9` of the worker the rows left are sent
  again at start (`restore`), and the stream's duplicate window drops a copy it holds (`Nats-Msg-Id`
  `<worker>:<machine>:<log seq>:audit`). A killed nats-server loses no acked record (the stream is fsync'd).
- Its own loop, not the events' rounds: the audit stream lives at home in a supercluster, so a region cut off from
  home cannot deliver there; its events and index entries must not wait for that, nor for its timeouts.
- Rounds as the outbox's (`bus.transport.batch_publish`): a batch published at once, acks awaited together;
  what failed stays and is sent again with a backoff of 0.05 s doubling to 2 s; one warning when deliveries
  start failing and one line when they flow again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable

import msgspec

from bus.transport.audit import audit_subject
from bus.transport.batch_publish import BatchPublisher, Message, deliver_rounds
from bus.transport.nats_adapter import Nats
from workers.log.records import MachineRecord, PendingAudit

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"


def audit_msg_id(worker_id: str, pending: PendingAudit) -> str:
    """The record's id for the audit stream's deduplication: the same on every retry and restart."""
    return f"{worker_id}:{pending.machine_id}:{pending.seq}:audit"


def audits_of(record: MachineRecord) -> list[PendingAudit]:
    """The audit records a committed log record keeps: its `created` event's, for a create through the brokers
    (the reserve's commit writes the same in table `audit`)."""
    machine = record.stored.machine
    return [
        PendingAudit(seq=record.seq, app=machine.app, machine_id=machine.id, record=event.audit)
        for event in record.stored.events
        if event.seq == record.seq and event.audit is not None and event.status == "created"
    ]


class AuditOutbox:
    """Queue with `committed` (the commit hook) and `restore` (at start); run `run()` as a task."""

    def __init__(
        self,
        nc: Nats,
        *,
        worker_id: str,
        delivered: Callable[[list[int]], None],
        batch: int = 256,
        timeout: float = 3.0,
        retry_min: float = 0.05,
        retry_max: float = 2.0,
    ) -> None:
        self._nc = nc
        self._publisher = BatchPublisher(nc, timeout=timeout)
        self.worker_id = worker_id
        self._delivered = delivered  # the seqs the audit stream acked (their rows go: `Store.audits_delivered`)
        self.batch = batch
        self.retry_min = retry_min
        self.retry_max = retry_max
        self._queue: dict[int, Message] = {}  # reserve's log seq -> its record's message, oldest first
        self._wake = asyncio.Event()
        self._failing_since: float | None = None
        self.delivered = 0  # records acknowledged since start

    @property
    def pending(self) -> int:
        return len(self._queue)

    def restore(self, pending: Iterable[PendingAudit]) -> None:
        """At start: the records a run before this one kept and did not see acknowledged."""
        for one in pending:
            self._add(one)
        if self._queue:
            log.info("audit outbox: %d audit record(s) of creates before this start to deliver", self.pending)

    def committed(self, record: MachineRecord) -> None:
        for one in audits_of(record):
            self._add(one)

    def _add(self, pending: PendingAudit) -> None:
        self._queue[pending.seq] = (
            audit_subject(pending.app),
            msgspec.json.encode(pending.record),
            {MSG_ID_HEADER: audit_msg_id(self.worker_id, pending)},
        )
        self._wake.set()

    async def run(self) -> None:
        await deliver_rounds(
            self._nc,
            ready=lambda: bool(self._queue),
            wake=self._wake,
            send_round=self._round,
            failing=self._failing,
            recovered=self._recovered,
            retry_min=self.retry_min,
            retry_max=self.retry_max,
        )

    async def _round(self) -> tuple[int, BaseException | str | None]:
        """Send up to a batch at once: how many were acknowledged, and the first failure (None: none failed)."""
        sent = list(itertools.islice(self._queue.items(), self.batch))
        results = await self._publisher.send([message for _, message in sent])
        acked = [seq for (seq, _), result in zip(sent, results, strict=True) if result is None]
        for seq in acked:
            del self._queue[seq]  # a row is kept once: a seq is never queued again after it was acked
        if acked:
            self._delivered(acked)
            self.delivered += len(acked)
        return len(acked), next((result for result in results if result is not None), None)

    def _failing(self, error: BaseException | str) -> None:
        if self._failing_since is not None:
            return
        self._failing_since = time.monotonic()
        reason = error if isinstance(error, str) else f"{type(error).__name__} {error}".strip()
        log.warning(
            "audit outbox: the audit stream is not taking records (%s); holding %d, kept in LMDB until it does",
            reason,
            self.pending,
        )

    def _recovered(self) -> None:
        if self._failing_since is None:
            return
        log.info(
            "audit outbox: the audit stream takes records again after %.1fs; %d pending",
            time.monotonic() - self._failing_since,
            self.pending,
        )
        self._failing_since = None

    async def flush(self) -> None:
        """Wait until everything queued so far has been acknowledged (callers bound it)."""
        while self._queue:
            await asyncio.sleep(0.02)
