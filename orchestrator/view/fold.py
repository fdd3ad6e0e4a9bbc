"""The write side of the view: events and heartbeats folded into its tables (fed by `follower`).

`ViewWriter.apply_events` is the one way events get in: one SQLite transaction per batch, which also
stores the sequence of the last event applied, so a reader that stops anywhere resumes exactly and an
event at or below that sequence is a no-op. Events of different workers may arrive in any order; a
machine lives on one worker, so its row follows that worker's own log sequence (`event.seq`), never
arrival order. Folding is deterministic: delete the file (or `reset`) and replaying the stream builds
the same tables, which is what `needs_rebuild` relies on when the view cannot simply continue.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable

import msgspec

from bus.contract.fleet import WorkerInfo
from bus.contract.machines import MachineEvent
from orchestrator.view.db import TABLES, ViewDb
from orchestrator.view.model import RELEASE_KEY, role_of


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


class ViewWriter:
    """Everything that changes the view's file: events, heartbeats, and which stream it follows.

    `history=False` keeps current state only (machines, apps, workers) and no row per event: a view that lives as
    long as a process and never shows an event list (the web console's) then grows with the machines, not with
    every event the stream carries."""

    def __init__(self, db: ViewDb, *, history: bool = True) -> None:
        self.db = db
        self.history = history

    def identity(self) -> StreamIdentity:
        return StreamIdentity(created=self.db.meta("stream_created"), last_seq=self.db.last_seq)

    def bind_stream(self, created: str, first_seq: int) -> None:
        """Remember which stream this view follows, and forget history the stream no longer holds."""
        with self.db.write():
            self.db.set_meta("stream_created", created)
            self.db.conn.execute("DELETE FROM events WHERE stream_seq < ?", (first_seq,))

    def reset(self) -> None:
        """Forget everything, in one transaction (safe while another process reads the same file)."""
        with self.db.write():
            for table in TABLES:
                self.db.conn.execute(f"DELETE FROM {table}")

    # ------------------------------------------------------------------------------------------
    # events in

    def apply_events(self, batch: Iterable[tuple[int, MachineEvent | None]]) -> int:
        """Apply `(stream_seq, event)` pairs in one transaction; returns how many were new.

        `None` stands for a message that was not an event (malformed): it only advances the sequence.
        """
        applied = 0
        with self.db.write():
            last = self.db.last_seq
            for stream_seq, event in batch:
                if stream_seq <= last:
                    continue
                if event is not None:
                    apply_event(self.db.conn, stream_seq, event, history=self.history)
                last = stream_seq
                applied += 1
            if applied:
                self.db.set_meta("last_seq", str(last))
        return applied

    # ------------------------------------------------------------------------------------------
    # heartbeats in (KV `fauxmad_workers`, key `<region>.<worker_id>`)

    def put_heartbeat(self, key: str, info: WorkerInfo | None, now: float) -> None:
        """A worker's heartbeat, or (`info=None`) its key deleted or expired: the worker is lost."""
        with self.db.write():
            if info is not None:
                self.db.conn.execute(
                    "INSERT INTO workers (worker_id, region, beating, info, heartbeat_at, seen_at, lost_at) "
                    "VALUES (?, ?, 1, ?, ?, ?, NULL) ON CONFLICT (worker_id) DO UPDATE SET region = excluded.region,"
                    " beating = 1, info = excluded.info, heartbeat_at = excluded.heartbeat_at,"
                    " seen_at = excluded.seen_at, lost_at = NULL",
                    (info.worker_id, info.region, msgspec.json.encode(info), info.heartbeat_at, now),
                )
                return
            region, _, worker_id = key.partition(".")
            self.db.conn.execute(
                "INSERT INTO workers (worker_id, region, beating, lost_at) VALUES (?, ?, 0, ?) "
                "ON CONFLICT (worker_id) DO UPDATE SET beating = 0, lost_at = coalesce(lost_at, excluded.lost_at)",
                (worker_id, region, now),
            )

    def lost_unless(self, keys: Iterable[str], now: float) -> None:
        """After a fresh read of the bucket: every worker not in it stopped beating while we were away."""
        beating = {key.partition(".")[2] for key in keys}
        with self.db.write():
            rows = self.db.conn.execute("SELECT worker_id FROM workers WHERE beating = 1").fetchall()
            for (worker_id,) in rows:
                if worker_id not in beating:
                    self.db.conn.execute(
                        "UPDATE workers SET beating = 0, lost_at = coalesce(lost_at, ?) WHERE worker_id = ?",
                        (now, worker_id),
                    )


def apply_event(db: sqlite3.Connection, stream_seq: int, event: MachineEvent, *, history: bool = True) -> None:
    """Fold one event into the tables (the caller holds the transaction and checks `stream_seq`); `history`: keep
    its row in `events` too."""
    ts = event.timestamp
    if history:
        db.execute(
            "INSERT OR IGNORE INTO events (stream_seq, seq, timestamp, region, worker_id, app, machine_id, type,"
            " status, from_state, source, reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
