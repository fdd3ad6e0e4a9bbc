"""The worker's LMDB environment: an append-only op log and the tables derived from it.

Layout (one place owns it): sub-database `log` maps an 8-byte big-endian sequence number to a
record; `machines` maps a machine id to its `StoredMachine`; `idempotency` maps an idempotency key
to a machine id; `images` maps an image name to the last time it was used; `volumes` maps a volume id
to its `Volume` (docs/tutorials/images-and-volumes.md); `meta` holds `worker` (cordon state). Every
change appends one log record and updates the derived tables in the same write transaction, so they can
never disagree, and `rebuild` recomputes them from the log alone to prove it. One table is not derived:
`audit` holds the creates' audit records that the audit stream has not acknowledged yet (delivery state, kept
by `workers.audit_outbox`: a row written with its reserve, dropped with a later commit once it is acked).

What one reserve does here (counted for issue 44), and why each part is needed:
- Transactions: one LMDB write transaction, the group commit's batch. A reserve alone in its batch runs in it
  directly; one among others runs in a nested transaction of its own, so it can fail alone. One commit makes the
  machine this worker's, checked and recorded atomically.
- `log`, written: one record, appended. The truth: the derived tables are rebuilt from it, compaction's replay
  check reads it, and the outbox restores from it the events the stream lacks after a crash (workers/outbox.py).
- `machines`, read (a retry of the same reserve; the record it replaces) and written: one row. A machine's
  current record by id, read by every verb and by the reserve's own checks; without it each read would replay
  the log.
- `meta`, read: the `worker` row. A cordon refuses the reserve inside the commit that would make it, so it is
  read there, not cached.
- `idempotency`, keyed reserves only: read and written. A broker's retry of a keyed create must find the key's
  machine inside the very commit that would otherwise reserve a second one.
- `volumes`, a machine with mounts only: each volume read and written `attached` (a log record each). Its
  volumes become its own in the same commit, or nothing is reserved.
- `audit`, a create through the brokers only (the reserve carries its audit record): one row written, and the
  rows of records the audit stream acknowledged since the last commit deleted. The record must outlive a
  `kill -9` until the audit stream has it (kept 90 days there, where the `created` event that also carries it
  is kept 7), and the log cannot be that place: compaction drops a reserve's record once a start supersedes it.
- Flushes: the commit writes its pages, fdatasyncs, then writes the meta page through LMDB's synchronous
  descriptor (`metasync`): two flushes, shared by every reserve of the batch (below: why both).

Not touched by a reserve: `images` (written when a machine starts). Not a table any more: the resources held
(`usage`, was a row of `meta` read and written by every reserve). They are a sum over `machines`, so they are
computed when the store opens (which reads the machines anyway) and kept in memory, changed only with the commits
that change them (`Tx` works on a copy, published when the batch's commit is durable): nothing is cached that
LMDB cannot give again.

Why both flushes stay. LMDB commits by copy-on-write: the new pages, then the meta page that points at them. The
fdatasync puts the pages on disk before the meta page is written (without it a power cut could leave a meta page
pointing at pages never written: a corrupt environment); the synchronous meta write puts the commit on disk before
the reserve is answered (without it, `MDB_NOMETASYNC`, a power cut undoes the last acknowledged commit). A `kill -9`
of the worker loses nothing either way (the page cache survives it); the flushes are what makes an answer hold
through a power cut, which is what "committed before it is answered" promises. The floor does the same (its
environment is opened with `sync` and `metasync`: `lab/bench/floor_responder.py`). `test_store.py` checks the flags.

Writes go through `workers.log.commit.GroupCommitter`: a writer thread takes every operation queued
meanwhile, runs each in its own nested transaction when there are several (one failing operation aborts
only itself) and commits them all in one transaction, with its flushes. Callers get their result only after
that commit, so nothing acknowledged is lost to a crash. Reads are lock-free LMDB read transactions on the
caller's thread.

Restart time does not grow with the log: the derived tables are persistent, so opening the store
reads nothing but the machines. Compaction drops log records a later record supersedes (and
destroyed machines past retention), which keeps the log bounded while replay stays exact.
"""

from __future__ import annotations

import collections
import contextlib
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import msgspec

from bus.contract.errors import NotFound
from bus.contract.volumes import Volume
from workers.log.machine_states import HOLDS_RESOURCES
from workers.log.records import (
    ImageRecord,
    LogRecord,
    MachineRecord,
    PendingAudit,
    StoredMachine,
    Usage,
    VolumeRecord,
    WorkerRecord,
    WorkerState,
    newest_events,
)

T = TypeVar("T")

DB_LOG = b"log"
DB_MACHINES = b"machines"
DB_IDEMPOTENCY = b"idempotency"
DB_IMAGES = b"images"
DB_META = b"meta"
DB_VOLUMES = b"volumes"
DB_AUDIT = b"audit"
KEY_WORKER = b"worker"

_SEQ = struct.Struct(">Q")
_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(LogRecord)
_machine_decoder = msgspec.json.Decoder(StoredMachine)
_worker_decoder = msgspec.json.Decoder(WorkerState)
_volume_decoder = msgspec.json.Decoder(Volume)
_audit_decoder = msgspec.json.Decoder(PendingAudit)


def seq_key(seq: int) -> bytes:
    return _SEQ.pack(seq)


class Tables(msgspec.Struct, kw_only=True):
    """The derived tables as plain values: what `snapshot` reads and `rebuild` recomputes."""

    machines: dict[str, StoredMachine]
    idempotency: dict[str, str]
    images: dict[str, float]
    usage: Usage
    worker: WorkerState
    volumes: dict[str, Volume] = {}


class Tx:
    """One operation's view of a write transaction. Only `store` and `GroupCommitter` create it."""

    def __init__(self, store: Store, txn: Any, now: float, usage: Usage | None = None) -> None:
        self._store = store
        self._txn = txn
        self.now = now
        self.records: list[LogRecord] = []
        # the resources held as this operation sees them (its own copy: what it changes is kept only if it
        # commits, `GroupCommitter` carries it to the next operation of the batch and publishes it at the end)
        self.held = msgspec.structs.replace(usage if usage is not None else store.usage())

    # reads inside the transaction -------------------------------------------------------------
    def get(self, machine_id: str) -> StoredMachine | None:
        raw = self._txn.get(machine_id.encode(), db=self._store.db_machines)
        return None if raw is None else _machine_decoder.decode(raw)

    def require(self, machine_id: str) -> StoredMachine:
        stored = self.get(machine_id)
        if stored is None:
            raise NotFound(f"machine {machine_id} not found on this worker")
        return stored

    def by_idempotency(self, key: str) -> StoredMachine | None:
        raw = self._txn.get(key.encode(), db=self._store.db_idempotency)
        return None if raw is None else self.get(raw.decode())

    def usage(self) -> Usage:
        return msgspec.structs.replace(self.held)

    def worker(self) -> WorkerState:
        raw = self._txn.get(KEY_WORKER, db=self._store.db_meta)
        return WorkerState() if raw is None else _worker_decoder.decode(raw)

    # writes: each appends exactly one log record ----------------------------------------------
    def _append(self, make: Callable[[int], LogRecord]) -> LogRecord:
        seq = self._store.next_seq(self._txn)
        record = make(seq)
        self._txn.put(seq_key(seq), _encoder.encode(record), db=self._store.db_log, append=True)
        self.records.append(record)
        return record

    def put_machine(self, stored: StoredMachine, op: str) -> StoredMachine:
        """Write `stored` (its version becomes this record's sequence) and keep the usage in step."""
        previous = self.get(stored.machine.id)

        def make(seq: int) -> LogRecord:
            stored.machine.version = seq
            stored.events = newest_events(stored.events)
            for event in reversed(stored.events):  # every event this record adds (an exit, then a state)
                if event.seq != 0:
                    break
                event.seq = seq
            return MachineRecord(seq=seq, at=self.now, op=op, stored=stored)

        self._append(make)
        apply_machine(self._txn, self._store, previous, stored, self.held)
        return stored

    def put_worker(self, state: WorkerState, op: str) -> None:
        def make(seq: int) -> LogRecord:
            state.seq = seq
            return WorkerRecord(seq=seq, at=self.now, op=op, state=state)

        self._append(make)
        self._txn.put(KEY_WORKER, _encoder.encode(state), db=self._store.db_meta)

    def volume(self, volume_id: str) -> Volume | None:
        raw = self._txn.get(volume_id.encode(), db=self._store.db_volumes)
        return None if raw is None else _volume_decoder.decode(raw)

    def require_volume(self, volume_id: str) -> Volume:
        volume = self.volume(volume_id)
        if volume is None:
            raise NotFound(f"volume {volume_id} not found on this worker")
        return volume

    def volumes(self) -> list[Volume]:
        return [_volume_decoder.decode(value) for _, value in self._txn.cursor(db=self._store.db_volumes)]

    def put_volume(self, volume: Volume, op: str) -> Volume:
        """Write `volume` (its version becomes this record's sequence): one log record, one table row."""

        def make(seq: int) -> LogRecord:
            volume.version = seq
            return VolumeRecord(seq=seq, at=self.now, op=op, volume=volume)

        self._append(make)
        self._txn.put(volume.id.encode(), _encoder.encode(volume), db=self._store.db_volumes)
        return volume

    def keep_audit(self, pending: PendingAudit) -> None:
        """Keep a create's audit record until the audit stream acknowledges it (`Store.audits_delivered`)."""
        self._txn.put(seq_key(pending.seq), _encoder.encode(pending), db=self._store.db_audit)

    def touch_image(self, image: str) -> None:
        if self._txn.get(image.encode(), db=self._store.db_images) is None:
            self._append(lambda seq: ImageRecord(seq=seq, at=self.now, op="image_cached", image=image))
            self._txn.put(image.encode(), _encoder.encode(self.now), db=self._store.db_images)


def apply_machine(txn: Any, store: Store, previous: StoredMachine | None, stored: StoredMachine, usage: Usage) -> None:
    """Update the derived tables and `usage` (changed in place) for one machine record."""
    machine = stored.machine
    txn.put(machine.id.encode(), _encoder.encode(stored), db=store.db_machines)
    if stored.idempotency_key:
        txn.put(stored.idempotency_key.encode(), machine.id.encode(), db=store.db_idempotency)
    held_before = previous is not None and previous.machine.state in HOLDS_RESOURCES
    held_now = machine.state in HOLDS_RESOURCES
    if held_before == held_now and (previous is None or previous.machine.config.guest == machine.config.guest):
        return
    if held_before and previous is not None:
        usage.cpus -= previous.machine.config.guest.cpus
        usage.memory_mb -= previous.machine.config.guest.memory_mb
        usage.machines -= 1
    if held_now:
        usage.cpus += machine.config.guest.cpus
        usage.memory_mb += machine.config.guest.memory_mb
        usage.machines += 1


def held_by(machines: Iterator[StoredMachine]) -> Usage:
    """The resources the machines hold: what `usage` is, by definition."""
    usage = Usage()
    for stored in machines:
        if stored.machine.state in HOLDS_RESOURCES:
            usage.cpus += stored.machine.config.guest.cpus
            usage.memory_mb += stored.machine.config.guest.memory_mb
            usage.machines += 1
    return usage


class Store:
    """One LMDB environment per worker. Thread-safe: reads anywhere, writes via `GroupCommitter`."""

    def __init__(
        self,
        path: str | Path,
        *,
        map_size: int = 8 * 1024 * 1024 * 1024,
        sync: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.env = lmdb.open(
            str(self.path),
            map_size=map_size,
            max_dbs=8,
            sync=sync,
            metasync=sync,
            writemap=False,
            map_async=False,
            readahead=False,
            max_readers=256,
            mode=0o600,  # the op log holds every machine's config and env: the worker's alone
        )
        self.db_log = self.env.open_db(DB_LOG)
        self.db_machines = self.env.open_db(DB_MACHINES)
        self.db_idempotency = self.env.open_db(DB_IDEMPOTENCY)
        self.db_images = self.env.open_db(DB_IMAGES)
        self.db_meta = self.env.open_db(DB_META)
        self.db_volumes = self.env.open_db(DB_VOLUMES)
        self.db_audit = self.env.open_db(DB_AUDIT)
        # audit rows acked by the audit stream (any thread appends), deleted by the next commit (`drop_delivered`)
        self._delivered: collections.deque[int] = collections.deque()
        self._seq = self._load_last_seq()
        with self.env.begin() as txn:  # the resources held, from the machines (see the top)
            self._usage = held_by(_machine_decoder.decode(v) for _, v in txn.cursor(db=self.db_machines))

    def _load_last_seq(self) -> int:
        with self.env.begin(db=self.db_log) as txn:
            cursor = txn.cursor()
            return int(_SEQ.unpack(cursor.key())[0]) if cursor.last() else 0

    def next_seq(self, txn: Any) -> int:
        # only the writer thread calls this, inside its write transaction
        self._seq += 1
        return self._seq

    @contextlib.contextmanager
    def rollback_seq(self) -> Iterator[None]:
        """Give back the sequence numbers taken inside the block if it raises (its transaction aborted)."""
        seq_before = self._seq
        try:
            yield
        except BaseException:
            self._seq = seq_before
            raise

    @property
    def last_seq(self) -> int:
        return self._seq

    def close(self) -> None:
        self.env.close()

    # writes, for the committer ----------------------------------------------------------------
    def write(self, fn: Callable[[Tx], T]) -> T:
        """Run one operation in its own write transaction (one fsync). For tools and tests."""
        with self.rollback_seq(), self.env.begin(write=True) as txn:
            tx = Tx(self, txn, self.clock())
            result = fn(tx)
        self.publish_usage(tx.held)
        return result

    # the audit records to deliver (`workers.audit_outbox`) --------------------------------------
    def audits_to_deliver(self) -> list[PendingAudit]:
        """Every create's audit record the audit stream has not acknowledged (as far as the last commit knows)."""
        with self.env.begin() as txn:
            return [_audit_decoder.decode(value) for _, value in txn.cursor(db=self.db_audit)]

    def audits_delivered(self, seqs: list[int]) -> None:
        """(any thread) The audit stream acknowledged these records: their rows go with the next commit, which
        runs anyway (or within a second when the worker is idle: `GroupCommitter`), never with one of their own
        that a reserve would wait behind. A row still there after a crash is sent again, and the stream's
        duplicate window drops the copy."""
        self._delivered.extend(seqs)

    @property
    def delivered_waiting(self) -> bool:
        return bool(self._delivered)

    def drop_delivered(self, txn: Any) -> list[int]:
        """(the writer, in its transaction) Delete the rows acked since the last commit; returns them, for
        `undrop_delivered` if that transaction aborts."""
        taken: list[int] = []
        while self._delivered:
            seq = self._delivered.popleft()
            txn.delete(seq_key(seq), db=self.db_audit)
            taken.append(seq)
        return taken

    def undrop_delivered(self, taken: list[int]) -> None:
        self._delivered.extendleft(reversed(taken))

    # reads ------------------------------------------------------------------------------------
    def get(self, machine_id: str) -> StoredMachine | None:
        with self.env.begin() as txn:
            raw = txn.get(machine_id.encode(), db=self.db_machines)
            return None if raw is None else _machine_decoder.decode(raw)

    def machines(self) -> list[StoredMachine]:
        with self.env.begin() as txn:
            return [_machine_decoder.decode(value) for _, value in txn.cursor(db=self.db_machines)]

    def usage(self) -> Usage:
        """The resources the machines hold now (a copy)."""
        return msgspec.structs.replace(self._usage)

    def publish_usage(self, usage: Usage) -> None:
        """After a durable commit (the writer thread): the resources held from now on. The object is replaced,
        never changed, so a reader on another thread sees the one before or this one, whole."""
        self._usage = msgspec.structs.replace(usage)

    def worker(self) -> WorkerState:
        with self.env.begin() as txn:
            raw = txn.get(KEY_WORKER, db=self.db_meta)
            return WorkerState() if raw is None else _worker_decoder.decode(raw)

    def volume(self, volume_id: str) -> Volume | None:
        with self.env.begin() as txn:
            raw = txn.get(volume_id.encode(), db=self.db_volumes)
            return None if raw is None else _volume_decoder.decode(raw)

    def volumes(self) -> list[Volume]:
        with self.env.begin() as txn:
            return [_volume_decoder.decode(value) for _, value in txn.cursor(db=self.db_volumes)]

    def images(self) -> list[str]:
        with self.env.begin() as txn:
            return [key.decode() for key, _ in txn.cursor(db=self.db_images)]

    def log(self, start: int = 0) -> Iterator[LogRecord]:
        with self.env.begin() as txn:
            cursor = txn.cursor(db=self.db_log)
            if not cursor.set_range(seq_key(start)):
                return
            for _, value in cursor:
                yield _record_decoder.decode(value)

    def log_length(self) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self.db_log)["entries"])

    def snapshot(self) -> Tables:
        with self.env.begin() as txn:
            machines = {k.decode(): _machine_decoder.decode(v) for k, v in txn.cursor(db=self.db_machines)}
            idem = {k.decode(): v.decode() for k, v in txn.cursor(db=self.db_idempotency)}
            images = {k.decode(): float(msgspec.json.decode(v)) for k, v in txn.cursor(db=self.db_images)}
            raw_worker = txn.get(KEY_WORKER, db=self.db_meta)
            volumes = {k.decode(): _volume_decoder.decode(v) for k, v in txn.cursor(db=self.db_volumes)}
        return Tables(
            volumes=volumes,
            machines=machines,
            idempotency=idem,
            images=images,
            usage=self.usage(),
            worker=_worker_decoder.decode(raw_worker) if raw_worker else WorkerState(),
        )

    def rebuild(self) -> Tables:
        """Recompute every derived table from the op log alone (it does not touch the live tables)."""
        machines: dict[str, StoredMachine] = {}
        images: dict[str, float] = {}
        volumes: dict[str, Volume] = {}
        worker = WorkerState()
        for record in self.log():
            match record:
                case MachineRecord(stored=stored):
                    machines[stored.machine.id] = stored
                case WorkerRecord(state=state):
                    worker = state
                case ImageRecord(image=image, at=at):
                    images.setdefault(image, at)
                case VolumeRecord(volume=volume):
                    volumes[volume.id] = volume
        usage = held_by(iter(machines.values()))
        idem: dict[str, str] = {}
        for stored in machines.values():
            if stored.idempotency_key:
                idem[stored.idempotency_key] = stored.machine.id
        return Tables(machines=machines, idempotency=idem, images=images, usage=usage, worker=worker, volumes=volumes)

    def compact(self, *, keep_last: int, destroyed_retention: float, limit: int = 50_000) -> int:
        """Drop superseded log records older than the newest `keep_last`; return how many went.

        A machine record is superseded when the machine's current version is a later record; a
        destroyed machine older than `destroyed_retention` seconds leaves the log and the table
        together, so a replay still equals the live tables. Bounded by `limit` per call, so one
        call never holds the write lock for long.
        """
        horizon = self._seq - keep_last
        if horizon <= 0:
            return 0
        now = self.clock()
        deleted = 0
        latest_worker = self.worker().seq
        with self.env.begin(write=True) as txn:
            cursor = txn.cursor(db=self.db_log)
            if not cursor.first():
                return 0
            while deleted < limit:
                seq = int(_SEQ.unpack(cursor.key())[0])
                if seq > horizon:
                    break
                record = _record_decoder.decode(cursor.value())
                if self._superseded(txn, record, latest_worker, now, destroyed_retention):
                    if not cursor.delete():
                        break
                    deleted += 1
                elif not cursor.next():
                    break
        return deleted

    def _superseded(self, txn: Any, record: LogRecord, latest_worker: int, now: float, retention: float) -> bool:
        if isinstance(record, WorkerRecord):
            return record.seq != latest_worker
        if isinstance(record, ImageRecord):
            return False
        if isinstance(record, VolumeRecord):  # the latest record of a volume stays (destroyed ones too)
            raw_volume = txn.get(record.volume.id.encode(), db=self.db_volumes)
            return raw_volume is None or _volume_decoder.decode(raw_volume).version != record.seq
        machine = record.stored.machine
        raw = txn.get(machine.id.encode(), db=self.db_machines)
        if raw is None:
            return True
        current = _machine_decoder.decode(raw)
        if current.machine.version != record.seq:
            return True
        if current.machine.state == "destroyed" and now - record.at > retention:
            txn.delete(machine.id.encode(), db=self.db_machines)
            if current.idempotency_key:
                txn.delete(current.idempotency_key.encode(), db=self.db_idempotency)
            return True
        return False
