"""The view's SQLite file: events and heartbeats go in, snapshots come out.

Tables: `events` (the history, keyed by stream sequence), `machines` (one row per machine, from its
newest event), `apps`, `workers` (identity from events; capacity, usage and liveness from the
heartbeats in KV `fauxmad_workers`) and `meta` (the stream sequence applied last, and the identity
of the stream it came from).

`apply_events` is the one way events get in: one SQLite transaction per batch, which also stores the
sequence of the last event applied, so a reader that stops anywhere resumes exactly and an event at
or below that sequence is a no-op. Events of different workers may arrive in any order; a machine
lives on one worker, so its row follows that worker's own log sequence (`event.seq`), never arrival
order. The file is a cache: delete it (or `reset`) and replaying the stream builds the same tables.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from bus.jetstream import WORKER_TTL
from bus.messages import MachineEvent, Resources, WorkerInfo
from orchestrator.view.model import (
    CORDONED,
    LOST,
    READY,
    RELEASE_KEY,
    UNREACHABLE,
    EventRow,
    MachineGroup,
    MachineRow,
    RegionRow,
    Snapshot,
    WorkerRow,
    role_of,
    worst_check,
)

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
LOST_SHOWN_FOR = 3600.0  # a lost worker with no machines left is shown for an hour, then only kept

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE events (
    stream_seq INTEGER PRIMARY KEY, seq INTEGER NOT NULL, timestamp REAL NOT NULL,
    region TEXT NOT NULL, worker_id TEXT NOT NULL, app TEXT NOT NULL, machine_id TEXT NOT NULL,
    type TEXT NOT NULL, status TEXT NOT NULL, from_state TEXT, source TEXT NOT NULL, reason TEXT
);
CREATE INDEX events_by_app ON events (app, stream_seq);
CREATE INDEX events_by_machine ON events (machine_id, stream_seq);
CREATE TABLE machines (
    id TEXT NOT NULL, app TEXT NOT NULL, region TEXT NOT NULL, worker_id TEXT NOT NULL,
    state TEXT NOT NULL, version INTEGER NOT NULL, stream_seq INTEGER NOT NULL,
    release TEXT NOT NULL DEFAULT '', role TEXT NOT NULL DEFAULT '', labels_version INTEGER NOT NULL DEFAULT -1,
    checks TEXT NOT NULL DEFAULT '{}', exit_code INTEGER, created_at REAL NOT NULL, updated_at REAL NOT NULL,
    instance_id TEXT,
    PRIMARY KEY (worker_id, id)
);
CREATE INDEX machines_by_app ON machines (app);
CREATE TABLE apps (name TEXT PRIMARY KEY, first_event REAL NOT NULL, last_event REAL NOT NULL, events INTEGER NOT NULL);
CREATE TABLE workers (
    worker_id TEXT PRIMARY KEY, region TEXT NOT NULL, last_event REAL,
    beating INTEGER NOT NULL DEFAULT 0, info BLOB, heartbeat_at REAL, seen_at REAL, lost_at REAL
);
"""
_TABLES = ("meta", "events", "machines", "apps", "workers")

# what a rebuild must reproduce exactly: everything that comes from the stream
DUMP_QUERIES = {
    "events": "SELECT * FROM events ORDER BY stream_seq",
    "machines": "SELECT * FROM machines ORDER BY id, worker_id",
    "apps": "SELECT * FROM apps ORDER BY name",
    "workers": "SELECT worker_id, region, last_event FROM workers WHERE last_event IS NOT NULL ORDER BY worker_id",
    "meta": "SELECT * FROM meta WHERE key = 'last_seq'",
}

_info_decoder = msgspec.json.Decoder(WorkerInfo)


class StreamIdentity(msgspec.Struct, frozen=True):
    """Which stream the view was built from, and how far: enough to tell a stale view from a live one."""

    created: str
    last_seq: int


def needs_rebuild(view: StreamIdentity, first_seq: int, last_seq: int, created: str) -> str | None:
    """Why a view built up to `view` cannot simply continue on the stream as it is now (None: it can)."""
    if view.last_seq == 0:
        return None
    if view.created and created and view.created != created:
        return "the events stream was recreated"
    if view.last_seq > last_seq:
        return f"the view is at event {view.last_seq} but the stream ends at {last_seq}"
    if view.last_seq + 1 < first_seq:
        return f"events {view.last_seq + 1}..{first_seq - 1} aged out of the stream before the view saw them"
    return None


class ViewStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._connect()
        except sqlite3.DatabaseError as exc:  # not a database, or from a future schema: it is a cache
            log.warning("view %s unusable (%s): starting afresh", self.path, exc)
            self._unlink()
            return self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path), isolation_level=None, timeout=10.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                with self._write(db):
                    for table in _TABLES:
                        db.execute(f"DROP TABLE IF EXISTS {table}")
                    for statement in filter(str.strip, _SCHEMA.split(";")):
                        db.execute(statement)  # not executescript: it would commit halfway
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except BaseException:
            db.close()
            raise
        return db

    def _unlink(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                Path(f"{self.path}{suffix}").unlink()

    @staticmethod
    @contextlib.contextmanager
    def _write(db: sqlite3.Connection) -> Iterator[None]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        self.db.close()

    # ------------------------------------------------------------------------------------------
    # meta

    def _meta(self, key: str, default: str = "") -> str:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else default

    def _set_meta(self, key: str, value: str) -> None:
        self.db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    @property
    def last_seq(self) -> int:
        return int(self._meta("last_seq", "0"))

    def identity(self) -> StreamIdentity:
        return StreamIdentity(created=self._meta("stream_created"), last_seq=self.last_seq)

    def bind_stream(self, created: str, first_seq: int) -> None:
        """Remember which stream this view follows, and forget history the stream no longer holds."""
        with self._write(self.db):
            self._set_meta("stream_created", created)
            self.db.execute("DELETE FROM events WHERE stream_seq < ?", (first_seq,))

    def reset(self) -> None:
        """Forget everything, in one transaction (safe while another process reads the same file)."""
        with self._write(self.db):
            for table in _TABLES:
                self.db.execute(f"DELETE FROM {table}")

    # ------------------------------------------------------------------------------------------
    # events in

    def apply_events(self, batch: Iterable[tuple[int, MachineEvent | None]]) -> int:
        """Apply `(stream_seq, event)` pairs in one transaction; returns how many were new.

        `None` stands for a message that was not an event (malformed): it only advances the sequence.
        """
        applied = 0
        with self._write(self.db):
            last = self.last_seq
            for stream_seq, event in batch:
                if stream_seq <= last:
                    continue
                if event is not None:
                    apply_event(self.db, stream_seq, event)
                last = stream_seq
                applied += 1
            if applied:
                self._set_meta("last_seq", str(last))
        return applied

    # ------------------------------------------------------------------------------------------
    # heartbeats in (KV `fauxmad_workers`, key `<region>.<worker_id>`)

    def put_heartbeat(self, key: str, info: WorkerInfo | None, now: float) -> None:
        """A worker's heartbeat, or (`info=None`) its key deleted or expired: the worker is lost."""
        with self._write(self.db):
            if info is not None:
                self.db.execute(
                    "INSERT INTO workers (worker_id, region, beating, info, heartbeat_at, seen_at, lost_at) "
                    "VALUES (?, ?, 1, ?, ?, ?, NULL) ON CONFLICT (worker_id) DO UPDATE SET region = excluded.region,"
                    " beating = 1, info = excluded.info, heartbeat_at = excluded.heartbeat_at,"
                    " seen_at = excluded.seen_at, lost_at = NULL",
                    (info.worker_id, info.region, msgspec.json.encode(info), info.heartbeat_at, now),
                )
                return
            region, _, worker_id = key.partition(".")
            self.db.execute(
                "INSERT INTO workers (worker_id, region, beating, lost_at) VALUES (?, ?, 0, ?) "
                "ON CONFLICT (worker_id) DO UPDATE SET beating = 0, lost_at = coalesce(lost_at, excluded.lost_at)",
                (worker_id, region, now),
            )

    def lost_unless(self, keys: Iterable[str], now: float) -> None:
        """After a fresh read of the bucket: every worker not in it stopped beating while we were away."""
        beating = {key.partition(".")[2] for key in keys}
        with self._write(self.db):
            rows = self.db.execute("SELECT worker_id FROM workers WHERE beating = 1").fetchall()
            for (worker_id,) in rows:
                if worker_id not in beating:
                    self.db.execute(
                        "UPDATE workers SET beating = 0, lost_at = coalesce(lost_at, ?) WHERE worker_id = ?",
                        (now, worker_id),
                    )

    # ------------------------------------------------------------------------------------------
    # snapshots out

    def known_app(self, app: str) -> bool:
        return self.db.execute("SELECT 1 FROM apps WHERE name = ?", (app,)).fetchone() is not None

    def snapshot(
        self,
        now: float,
        *,
        app: str | None = None,
        events: int = 10,
        include_destroyed: bool = False,
        machines: bool = True,
        ttl: float = WORKER_TTL,
    ) -> Snapshot:
        """One consistent read of the view (a read transaction): see `model.Snapshot`.

        `machines=False` leaves out the per-machine rows (the live view shows only `groups`).
        """
        self.db.execute("BEGIN")
        try:
            workers = self._workers(now, ttl, app)
            rows = self._machines(app, include_destroyed) if machines else []
            rows = _with_host_status(rows, workers)
            groups = self._groups(app)
            tail = self._events(app, events)
            apps = [row[0] for row in self.db.execute("SELECT name FROM apps ORDER BY name")]
            stream_seq = self.last_seq
        finally:
            self.db.execute("COMMIT")
        return Snapshot(
            taken_at=now,
            stream_seq=stream_seq,
            apps=apps,
            regions=_regions(workers, groups),
            workers=workers,
            machines=rows,
            groups=groups,
            events=tail,
        )

    def _machines(self, app: str | None, include_destroyed: bool) -> list[MachineRow]:
        rows = _named(
            self.db.execute(
                "SELECT id, app, region, worker_id, state, release, role, checks, exit_code, version, updated_at "
                "FROM machines WHERE (? OR state != 'destroyed') AND (? IS NULL OR app = ?) ORDER BY region, app, id",
                (include_destroyed, app, app),
            )
        )
        out = []
        for row in rows:
            row["checks"] = json.loads(row["checks"])
            row["release"] = row["release"] or None
            row["role"] = row["role"] or None
            out.append(MachineRow(**row, check_status=worst_check(row["checks"])))
        return out

    def _groups(self, app: str | None) -> list[MachineGroup]:
        rows = self.db.execute(
            "SELECT region, app, state, role, count(*) FROM machines WHERE state != 'destroyed' "
            "AND (? IS NULL OR app = ?) GROUP BY region, app, state, role ORDER BY region, app, state, role",
            (app, app),
        )
        return [MachineGroup(region=r, app=a, state=s, role=role, count=n) for r, a, s, role, n in rows]

    def _workers(self, now: float, ttl: float, app: str | None) -> list[WorkerRow]:
        held = dict(
            self.db.execute(
                "SELECT worker_id, count(*) FROM machines WHERE state != 'destroyed' AND (? IS NULL OR app = ?) "
                "GROUP BY worker_id",
                (app, app),
            ).fetchall()
        )
        rows = self.db.execute(
            "SELECT worker_id, region, beating, info, heartbeat_at, seen_at, lost_at FROM workers "
            "ORDER BY region, worker_id"
        )
        out = []
        for worker_id, region, beating, info_json, heartbeat_at, seen_at, lost_at in rows:
            if app is not None and worker_id not in held:
                continue
            info = _info_decoder.decode(info_json) if info_json else None
            fresh = bool(beating) and now - max(seen_at or 0.0, heartbeat_at or 0.0) <= ttl
            if not fresh and not held.get(worker_id) and now - (lost_at or 0.0) > LOST_SHOWN_FOR:
                continue  # long gone and holding nothing: kept, not shown
            status = (CORDONED if info is not None and info.cordoned else READY) if fresh else LOST
            out.append(
                WorkerRow(
                    worker_id=worker_id,
                    region=region,
                    status=status,
                    capacity=info.capacity if info else Resources(),
                    used=info.used if info else Resources(),
                    machines=info.machines if info and fresh else held.get(worker_id, 0),
                    cordoned=bool(info and info.cordoned),
                    load=info.load if info else 0.0,
                    heartbeat_at=heartbeat_at,
                    states=dict(info.states) if info else {},
                )
            )
        return out

    def _events(self, app: str | None, limit: int) -> list[EventRow]:
        if limit <= 0:
            return []
        rows = _named(
            self.db.execute(
                "SELECT stream_seq, timestamp, region, worker_id, app, machine_id, type, status, from_state, reason "
                "FROM events WHERE (? IS NULL OR app = ?) ORDER BY stream_seq DESC LIMIT ?",
                (app, app, limit),
            )
        )
        return [EventRow(**row) for row in reversed(rows)]

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row that comes from the stream, in a fixed order: what a rebuild must reproduce."""
        return {name: self.db.execute(query).fetchall() for name, query in DUMP_QUERIES.items()}


def _named(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """Rows as dicts keyed by column name (the columns are named as the record fields they fill)."""
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def apply_event(db: sqlite3.Connection, stream_seq: int, event: MachineEvent) -> None:
    """Fold one event into the tables (the caller holds the transaction and checks `stream_seq`)."""
    ts = event.timestamp
    db.execute(
        "INSERT OR IGNORE INTO events (stream_seq, seq, timestamp, region, worker_id, app, machine_id, type, status,"
        " from_state, source, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            stream_seq,
            event.seq,
            ts,
            event.region,
            event.worker_id,
            event.app,
            event.machine_id,
            event.type,
            event.status,
            event.from_state,
            event.source,
            event.reason,
        ),
    )
    db.execute(
        "INSERT INTO apps (name, first_event, last_event, events) VALUES (?, ?, ?, 1) ON CONFLICT (name) DO UPDATE"
        " SET first_event = min(first_event, excluded.first_event), last_event = max(last_event, excluded.last_event),"
        " events = events + 1",
        (event.app, ts, ts),
    )
    db.execute(
        "INSERT INTO workers (worker_id, region, last_event) VALUES (?, ?, ?) ON CONFLICT (worker_id) DO UPDATE"
        " SET last_event = max(coalesce(last_event, 0), excluded.last_event)",
        (event.worker_id, event.region, ts),
    )
    _fold_machine(db, stream_seq, event)


def _fold_machine(db: sqlite3.Connection, stream_seq: int, event: MachineEvent) -> None:
    """A machine's row follows its worker's newest event; a row is per worker, the source of truth for it."""
    key = (event.worker_id, event.machine_id)
    row = db.execute(
        "SELECT version, stream_seq, labels_version, checks, instance_id FROM machines WHERE worker_id = ? AND id = ?",
        key,
    ).fetchone()
    if row is None:
        db.execute(
            "INSERT INTO machines (worker_id, id, app, region, state, version, stream_seq, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, '', -1, 0, ?, ?)",
            (*key, event.app, event.region, event.timestamp, event.timestamp),
        )
        row = (-1, 0, -1, "{}", None)
    version, newest, labels_version, checks_json, instance_id = row
    if (event.seq, stream_seq) > (version, newest):
        checks = json.dumps(_checks_after(event, json.loads(checks_json), instance_id), sort_keys=True)
        db.execute(
            "UPDATE machines SET state = ?, version = ?, stream_seq = ?, checks = ?,"
            " exit_code = coalesce(?, exit_code), updated_at = ?, instance_id = coalesce(?, instance_id)"
            " WHERE worker_id = ? AND id = ?",
            (event.status, event.seq, stream_seq, checks, _exit_code(event), event.timestamp, event.instance_id, *key),
        )
    else:  # an older event arriving late only tells how old the machine is
        db.execute(
            "UPDATE machines SET created_at = min(created_at, ?) WHERE worker_id = ? AND id = ?",
            (event.timestamp, *key),
        )
    if event.metadata is not None and event.seq >= labels_version:
        db.execute(
            "UPDATE machines SET release = ?, role = ?, labels_version = ? WHERE worker_id = ? AND id = ?",
            (event.metadata.get(RELEASE_KEY, ""), role_of(event.metadata), event.seq, *key),
        )


def _with_host_status(rows: list[MachineRow], workers: list[WorkerRow]) -> list[MachineRow]:
    """A machine on a worker that stopped beating is as its worker last said, on a host we cannot reach
    (Fly's `host_status`): its state and checks are the last known, not the present."""
    reachable = {w.worker_id for w in workers if w.status != LOST}
    return [
        row if row.worker_id in reachable else msgspec.structs.replace(row, host_status=UNREACHABLE) for row in rows
    ]


def _checks_after(event: MachineEvent, checks: dict[str, str], instance_id: str | None) -> dict[str, str]:
    """The worker forgets check results when a machine stops running or gets a new config: so does the view.

    A relabel in place (an `update` that keeps the running instance) keeps them, as the worker does.
    """
    if event.type == "check" and event.check is not None:
        return {**checks, event.check.name: event.check.status}
    if event.type == "update":
        kept = event.instance_id is not None and event.instance_id == instance_id
        return checks if kept else {}
    if event.type == "transition" and event.status != "started":
        return {}
    return checks


def _exit_code(event: MachineEvent) -> int | None:
    if event.type != "exit" or event.exit is None:
        return None
    if event.exit.exit_code is None and event.exit.signal is not None:
        return 128 + event.exit.signal  # the shell's convention for "killed by a signal"
    return event.exit.exit_code


def _regions(workers: list[WorkerRow], groups: list[MachineGroup]) -> list[RegionRow]:
    """Per region: beating workers' capacity and usage, lost workers counted apart, machines by state."""
    names = sorted({w.region for w in workers} | {g.region for g in groups})
    out = []
    for name in names:
        beating = [w for w in workers if w.region == name and w.status != LOST]
        states: dict[str, int] = {}
        for group in groups:
            if group.region == name:
                states[group.state] = states.get(group.state, 0) + group.count
        out.append(
            RegionRow(
                region=name,
                workers=len(beating),
                cordoned=sum(w.status == CORDONED for w in beating),
                lost=sum(w.region == name and w.status == LOST for w in workers),
                capacity=Resources(
                    cpus=sum(w.capacity.cpus for w in beating), memory_mb=sum(w.capacity.memory_mb for w in beating)
                ),
                used=Resources(
                    cpus=sum(w.used.cpus for w in beating), memory_mb=sum(w.used.memory_mb for w in beating)
                ),
                machines=sum(states.values()),
                states=dict(sorted(states.items())),
            )
        )
    return out
