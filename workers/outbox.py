"""The worker's outbox: every committed transition reaches NATS, however long NATS is away.

The worker's LMDB log is the truth; NATS holds two copies derived from it: the routing index (KV
`fauxmad_machines`, one entry per machine) and the history (stream `FAUXMAD_EVENTS`, every event).
Commits must never wait for NATS, so they only queue here, and one task delivers in the background.
It gives up on nothing: an item leaves the outbox only once NATS has acknowledged it, so after an
outage of any length both copies converge on the log.

- Events are history and cannot be merged: they are published through JetStream in commit order,
  each with a `Nats-Msg-Id` that is the same on every retry and every restart
  (`<worker>:<machine>:<log seq>:<n-th event of the record>`), so the stream's duplicate window
  (2 minutes) drops a copy whose first ack was lost. An outage longer than that window may leave
  a second copy of the few events in flight when the server died; the view is not misled by it
  (a machine's row follows the worker's log sequence, not the stream's).
- Index entries are state: a newer entry for a machine replaces one not yet sent, so the backlog
  is bounded by the number of machines, and a machine's entry always ends at its newest state.
- Each round pipelines a batch (all published at once, acks awaited together with one deadline: not
  one round trip per item, and no task or future per item, since the outbox shares the worker's event
  loop with its commits: `bus.transport.batch_publish`); what failed stays at the front and is retried with a
  backoff of 0.05 s doubling to 1 s. Index entries are KV puts and deletes on the bucket's subjects
  (`$KV.<bucket>.<key>`, a delete carries `KV-Operation: DEL`), pipelined the same way.
- A round that delivered nothing waits before the next; one that delivered some goes on at once,
  so an item NATS keeps refusing holds up nothing but itself.
- One warning when deliveries start failing, one info line when they flow again: never one per item.
- A reserve is answered once its machine's index entry is stored (`routed`, bounded): from the create's reply
  on, any broker finds the machine (its replica, or a direct read of the bucket). Only that ack is awaited, as
  it comes (`BatchPublisher.send`'s `on_ack`): not the round's other acks, nor the event's fsync. The events
  stream is the create's one durable write on the bus; the index bucket is a replica of the workers' logs
  that they rebuild (below), so on one server it is stored without an fsync per write (`persist_mode`
  async: `bus.transport.jetstream`).
- After the connection comes back (a server restarted, or this worker moved to another), every machine's index
  entry is queued again (`machines`): a bucket stored without an fsync per write may have lost its last
  writes to a killed server, and this puts them back (docs/explanation/architecture.md). Every machine, also
  one whose entry is in a round still in flight: the dead server may have acked it before losing it.
- A `created` event that carries its create's audit record goes on its machine's subject like every other
  event; the record itself goes to the audit stream from a lane of its own (`workers.audit_outbox`).
- On start, before this run commits anything, `republish` queues every machine's index entry and
  every event of its log that the stream lacks (those after the last one the stream has for that
  machine): events queued in memory when the worker died are not lost for good, however many records
  they span (for a machine the stream has nothing of, those younger than the stream's max age). Deliveries
  wait for those look-ups, so that no commit of this run reaches the stream first and hides the gap behind
  it; the restored events go out ahead of this run's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import msgspec

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.machines import Machine, MachineEvent, MachineIndexEntry, index_entry
from bus.transport.batch_publish import BatchPublisher, Message, deliver_rounds
from bus.transport.nats_adapter import Nats, NotFoundError, on_reconnect
from workers.log.records import MachineRecord, StoredMachine

log = logging.getLogger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
KV_OPERATION_HEADER = "KV-Operation"
NOTHING = (0, -1.0)  # the stream has no event of the machine (compared by identity)
Have = tuple[int, float] | None  # (log seq, n) of the stream's last event of a machine; None: unknown


def event_msg_id(worker_id: str, machine_id: str, seq: int, n: int) -> str:
    """The event's id for the stream's deduplication: unique, and the same on every retry and restart."""
    return f"{worker_id}:{machine_id}:{seq}:{n}"


def parse_msg_id(msg_id: str) -> tuple[int, int] | None:
    """`(log seq, n)` of an id made by `event_msg_id`, or None."""
    parts = msg_id.rsplit(":", 2)
    if len(parts) != 3:
        return None
    try:
        return int(parts[1]), int(parts[2])
    except ValueError:
        return None


def with_n(events: Sequence[MachineEvent]) -> list[tuple[int, MachineEvent]]:
    """`(n, event)` for a run of a machine's events: `n` is the event's place in its record."""
    out: list[tuple[int, MachineEvent]] = []
    for event in events:
        n = out[-1][0] + 1 if out and out[-1][1].seq == event.seq else 0
        out.append((n, event))
    return out


def missing(
    numbered: list[tuple[int, MachineEvent]], have: Have, kept_since: float | None
) -> list[tuple[int, MachineEvent]]:
    """Which of a machine's `(n, event)`s the stream lacks, given its last one there (`have`) and the oldest
    time it keeps (`kept_since`, epoch seconds; None: unknown). Nothing there: never delivered, or aged out,
    so what is younger than the stream keeps. Unknown: the newest record, which the duplicate window drops
    if it is there."""
    if have is NOTHING:
        if kept_since is not None:
            return [(n, event) for n, event in numbered if event.timestamp >= kept_since * 1000]
        have = None
    if have is None:
        newest = numbered[-1][1].seq if numbered else 0
        return [(n, event) for n, event in numbered if event.seq == newest]
    return [(n, event) for n, event in numbered if (event.seq, n) > have]


def record_events(events: Sequence[MachineEvent], seq: int) -> list[MachineEvent]:
    """The events that the record `seq` added: the tail of `events` carrying that sequence (an exit
    and the state it settled in share one record); their order is their `n`."""
    start = len(events)
    while start and events[start - 1].seq == seq:
        start -= 1
    return list(events[start:])


class PendingEvent(NamedTuple):
    subject: str
    payload: bytes
    headers: dict[str, str]  # its `Nats-Msg-Id`, made once: a retry sends the very same


class _Seq(msgspec.Struct):
    seq: int = 0


class Outbox:
    """Queue with `committed` (from the commit hook, never blocks) and run `run()` as a task."""

    def __init__(
        self,
        nc: Nats,
        *,
        worker_id: str,
        index_bucket: str = subjects.MACHINES_BUCKET,
        events_stream: str = subjects.EVENTS_STREAM,
        batch: int = 256,
        timeout: float = 3.0,
        retry_min: float = 0.05,
        retry_max: float = 1.0,
        clock: Callable[[], float] = time.time,
        address: str | None = None,
        machines: Callable[[], Iterable[Machine]] | None = None,
    ) -> None:
        self._nc = nc
        self.address = address  # the worker's advertised address: every index entry names it
        self._js = nc.jetstream(timeout=timeout)  # for the start-up lookups
        self._publisher = BatchPublisher(nc, timeout=timeout)
        self._index_bucket = index_bucket
        self._events_stream = events_stream
        self.worker_id = worker_id
        self.batch = batch
        self.timeout = timeout
        self.retry_min = retry_min
        self.retry_max = retry_max
        self.clock = clock  # epoch seconds: compared with the events' timestamps
        self._events: deque[PendingEvent] = deque()
        self._index: dict[str, MachineIndexEntry] = {}  # insertion ordered; the newest entry per machine
        self._wake = asyncio.Event()
        self._looked_up = asyncio.Event()  # cleared while `republish` asks the stream what it has
        self._looked_up.set()
        self._failing_since: float | None = None
        self._delivered_while_failing = 0
        self.delivered = 0  # events and index entries acknowledged, since start
        self._machines = machines  # every machine of the log now: queued again after a reconnect
        self._routed: dict[str, list[asyncio.Future[None]]] = {}  # machine id -> reserves awaiting its entry

    # queueing ---------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._events) + len(self._index)

    def committed(self, record: MachineRecord) -> None:
        """Queue what a committed record changed: its events, then the machine's index entry."""
        machine = record.stored.machine
        self._queue_events(machine, enumerate(record_events(record.stored.events, record.seq)))
        self.index(machine)

    def index(self, machine: Machine) -> None:
        entry = index_entry(machine)
        if self.address and entry.address != self.address:  # a machine of before a restart at another address
            entry = msgspec.structs.replace(entry, address=self.address)
        self._index[machine.id] = entry
        self._wake.set()

    def routed(self, machine_id: str) -> asyncio.Future[None]:
        """Resolved once an index entry of the machine queued so far is stored (at once if none is pending)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if machine_id in self._index:
            self._routed.setdefault(machine_id, []).append(future)
        else:
            future.set_result(None)
        return future

    def _resolve_routed(self, machine_id: str) -> None:
        for future in self._routed.pop(machine_id, ()):
            if not future.done():
                future.set_result(None)

    def _queue_events(self, machine: Machine, numbered: Iterable[tuple[int, MachineEvent]]) -> None:
        self._events.extend(self._pending(machine, numbered))
        self._wake.set()

    def _pending(self, machine: Machine, numbered: Iterable[tuple[int, MachineEvent]]) -> list[PendingEvent]:
        """`(n, event)` pairs as messages, each with its `Nats-Msg-Id`."""
        subject = subjects.events(machine.region, machine.worker_id, machine.app, machine.id)
        return [
            PendingEvent(
                subject, encode(event), {MSG_ID_HEADER: event_msg_id(self.worker_id, machine.id, event.seq, n)}
            )
            for n, event in numbered
        ]

    def republish(self, machines: list[StoredMachine], lookups: int = 64) -> asyncio.Task[None]:
        """At start, before any commit of this run: every machine's index entry now, and the events of
        its log that the stream lacks, from the task returned (the caller keeps and cancels it).

        The index entries are queued before this returns, so no commit can be overtaken by an older
        entry. For the events the stream is asked for each machine's last one, and what the log has
        after it is queued ahead of anything this run committed meanwhile; deliveries wait until every
        machine was looked up, since a newer event delivered first would hide the gap behind it. So a
        restart long after the duplicate window adds nothing that is there, and loses nothing that is
        not. Where the stream has nothing of a machine (never delivered, or aged out), every event younger
        than the stream's max age goes; where it cannot say, only the newest record goes again, and the
        window drops it if it is there (`missing`).
        """
        for stored in machines:
            self.index(stored.machine)
        logs = [(stored.machine, stored.events) for stored in machines if stored.events]
        self._looked_up.clear()

        async def one(
            machine: Machine, events: list[MachineEvent], kept_since: float | None
        ) -> tuple[Have, list[PendingEvent]]:
            have = await self._stream_has(subjects.events(machine.region, machine.worker_id, machine.app, machine.id))
            return have, self._pending(machine, missing(with_n(events), have, kept_since))

        async def look_up() -> None:
            restored: list[PendingEvent] = []
            unknown = lacking = 0
            try:
                kept_since = await self._kept_since()
                for start in range(0, len(logs), lookups):
                    looked = await asyncio.gather(
                        *(one(machine, events, kept_since) for machine, events in logs[start : start + lookups])
                    )
                    for have, pending in looked:
                        restored.extend(pending)
                        unknown += have is None
                        lacking += bool(pending)
                self._events.extendleft(reversed(restored))
                if restored:
                    log.info(
                        "outbox: the events stream lacked %d event(s) of %d machine(s): restored, ahead of this run's",
                        len(restored),
                        lacking,
                    )
                if unknown:
                    log.warning(
                        "outbox: %d of %d machines could not be looked up in the events stream: their newest record"
                        " goes again (the duplicate window drops it if it is there)",
                        unknown,
                        len(logs),
                    )
            finally:
                self._looked_up.set()
                self._wake.set()

        return asyncio.create_task(look_up())

    async def _kept_since(self) -> float | None:
        """The oldest time (epoch seconds) of what the events stream still keeps: 0 without a limit, None unknown."""
        try:
            info = await asyncio.wait_for(self._js.stream_info(self._events_stream), self.timeout)
        except Exception:
            log.debug("outbox: could not read the events stream's limits", exc_info=True)
            return None
        max_age = info.config.max_age or 0.0
        return self.clock() - max_age if max_age else 0.0

    async def _stream_has(self, subject: str) -> Have:
        """`(log seq, n)` of the last event on `subject` in the stream; NOTHING for none, None for unknown."""
        try:
            msg = await asyncio.wait_for(self._js.get_last_msg(self._events_stream, subject), self.timeout)
        except NotFoundError:
            return NOTHING
        except Exception:
            log.debug("outbox: could not look up %s in the events stream", subject, exc_info=True)
            return None
        parsed = parse_msg_id((msg.headers or {}).get(MSG_ID_HEADER, ""))
        if parsed is not None:
            return parsed
        try:  # published before events carried an id: the whole record counts as there
            return msgspec.json.decode(msg.data or b"{}", type=_Seq).seq, math.inf
        except msgspec.DecodeError:
            return None

    # delivering -------------------------------------------------------------------------------
    async def run(self) -> None:
        reindex = asyncio.create_task(self._reindex_after_reconnects())
        try:
            await self._deliver()
        finally:
            reindex.cancel()

    async def _reindex_after_reconnects(self, poll: float = 0.2) -> None:
        """Queue every machine's index entry again each time the connection has come back: told so by our
        `Connection` (`on_reconnect`), or for a plain nats-py client by a look at its counter every `poll`
        seconds."""
        if self._machines is None:
            return
        back = asyncio.Event()
        stop_hearing = on_reconnect(self._nc, back.set)
        seen = self._nc.stats["reconnects"]
        try:
            while True:
                if stop_hearing is None:
                    await asyncio.sleep(poll)
                else:
                    await back.wait()
                    back.clear()
                now = self._nc.stats["reconnects"]
                if now == seen or not self._nc.is_connected:
                    continue
                seen = now
                self._reindex()
        finally:
            if stop_hearing is not None:
                stop_hearing()

    def _reindex(self) -> None:
        """Every machine's index entry queued again (the connection came back)."""
        if self._machines is None:
            return
        try:
            machines = list(self._machines())
        except Exception:
            log.exception("outbox: could not read the machines to index them again")
            return
        # every one, even a machine whose entry is queued or in a round in flight: that round's ack may have
        # come from the server that died before writing it (an unsynced bucket acks before its write is on
        # disk), and the round would then drop the entry as delivered. A new entry object is kept by the
        # round (`_round` drops only the very entry it sent), so it goes again, from the log as it is now.
        for machine in machines:
            self.index(machine)

    async def _deliver(self) -> None:
        await deliver_rounds(
            self._nc,
            ready=lambda: bool(self.pending) and self._looked_up.is_set(),
            wake=self._wake,
            send_round=self._round,
            failing=self._failing,
            recovered=self._recovered,
            retry_min=self.retry_min,
            retry_max=self.retry_max,
        )

    async def _round(self) -> tuple[int, BaseException | str | None]:
        """Send up to a batch of events and of index entries at once: how many were delivered, and
        the first failure (None: all were)."""
        events = list(itertools.islice(self._events, self.batch))
        index = list(itertools.islice(self._index.values(), self.batch))
        first_entry = len(events)

        def on_ack(i: int, outcome: BaseException | None) -> None:
            if i >= first_entry and outcome is None and self._routed:
                self._resolve_routed(index[i - first_entry].id)

        results = await self._publisher.send(
            [(event.subject, event.payload, event.headers) for event in events]
            + [self._index_message(entry) for entry in index],
            on_ack,
        )
        event_results, index_results = results[: len(events)], results[len(events) :]
        # events: the sent ones are still the first len(events) of the deque (appends go to the right)
        failed = [event for event, result in zip(events, event_results, strict=True) if result is not None]
        for _ in events:
            self._events.popleft()
        self._events.extendleft(reversed(failed))
        for entry, result in zip(index, index_results, strict=True):
            # delivered, and not replaced by a newer entry meanwhile: done with this machine
            if result is None and self._index.get(entry.id) is entry:
                del self._index[entry.id]
                if self._routed:  # a reserve that asked after this entry's ack came
                    self._resolve_routed(entry.id)
        ok = sum(result is None for result in results)
        self.delivered += ok
        if self._failing_since is not None:
            self._delivered_while_failing += ok
        return ok, next((result for result in results if result is not None), None)

    def _index_message(self, entry: MachineIndexEntry) -> Message:
        subject = subjects.kv_put(self._index_bucket, entry.id)
        if entry.state == "destroyed":
            return subject, b"", {KV_OPERATION_HEADER: "DEL"}
        return subject, encode(entry), None

    def _failing(self, error: BaseException | str) -> None:
        if self._failing_since is not None:
            return
        self._failing_since = time.monotonic()
        self._delivered_while_failing = 0
        reason = error if isinstance(error, str) else (f"{type(error).__name__} {error}".strip())
        log.warning(
            "outbox: NATS is not taking deliveries (%s); holding %d events and %d index entries until it does",
            reason,
            len(self._events),
            len(self._index),
        )

    def _recovered(self) -> None:
        if self._failing_since is None:
            return
        log.info(
            "outbox: NATS takes deliveries again after %.1fs; %d items delivered since, %d pending",
            time.monotonic() - self._failing_since,
            self._delivered_while_failing,
            self.pending,
        )
        self._failing_since = None

    async def flush(self) -> None:
        """Wait until everything queued so far has been delivered (callers bound it)."""
        while self.pending:
            await asyncio.sleep(0.02)
