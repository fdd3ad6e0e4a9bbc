"""The view's SQLite file: its schema, its connection and its transactions, shared by both sides.

`fold` writes the file (events and heartbeats in), `query` reads it (snapshots out); neither opens it
or knows how the schema is made. The tables: `events` (the history, keyed by stream sequence),
`machines` (one row per machine, from its newest event), `apps`, `workers` (identity from events;
capacity, usage and liveness from the heartbeats in KV `fauxmad_workers`) and `meta` (the stream
sequence applied last, and the identity of the stream it came from).

The file is a cache, so it is never migrated: a file of another schema version is emptied and made
anew, and a file that is not a database is deleted; replaying the stream fills it again. WAL lets
`fauxmad status` read while a follower in another process writes.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2

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
TABLES = ("meta", "events", "machines", "apps", "workers")


class ViewDb:
    """One connection to the view's file (`":memory:"` for a view that lives as long as the object)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.conn = self._open()

    def __repr__(self) -> str:
        return f"ViewDb({str(self.path)!r})"

    def _open(self) -> sqlite3.Connection:
        if str(self.path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return _connect(self.path)
        except sqlite3.DatabaseError as exc:  # not a database, or from a future schema: it is a cache
            log.warning("view %s unusable (%s): starting afresh", self.path, exc)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(f"{self.path}{suffix}").unlink()
            return _connect(self.path)

    def write(self) -> contextlib.AbstractContextManager[None]:
        """A write transaction: taken at once (`BEGIN IMMEDIATE`), rolled back if the block raises."""
        return _transaction(self.conn, "BEGIN IMMEDIATE")

    def read(self) -> contextlib.AbstractContextManager[None]:
        """A read transaction: every query inside sees the same state of the file."""
        return _transaction(self.conn, "BEGIN")

    def meta(self, key: str, default: str = "") -> str:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else default

    def set_meta(self, key: str, value: str) -> None:
        self.conn.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    @property
    def last_seq(self) -> int:
        """The stream sequence of the last event applied (0: none yet)."""
        return int(self.meta("last_seq", "0"))

    def close(self) -> None:
        self.conn.close()


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, timeout=10.0)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:
            with _transaction(conn, "BEGIN IMMEDIATE"):
                for table in TABLES:
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    conn.execute(statement)  # not executescript: it would commit halfway
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.close()
        raise
    return conn


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    conn.execute(begin)
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
