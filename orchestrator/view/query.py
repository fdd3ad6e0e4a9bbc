"""The read side of the view: snapshots of its tables for `fauxmad status` and the live screen.

Reads never change the file, so they can run in any process while a follower writes (WAL). A snapshot
is one read transaction: regions, workers, machines and recent events all describe the same moment.
Liveness is decided here, at read time, from `now`: a worker whose last heartbeat is older than the
TTL counts as lost even before its expiry marker arrives, and a machine on such a worker is shown as
its worker last reported it, on a host we cannot reach.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import msgspec

from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Resources
from bus.transport.jetstream import WORKER_TTL
from orchestrator.view.db import ViewDb
from orchestrator.view.model import (
    CORDONED,
    LOST,
    READY,
    UNREACHABLE,
    EventRow,
    MachineGroup,
    MachineRow,
    RegionRow,
    Snapshot,
    WorkerRow,
    worst_check,
)

LOST_SHOWN_FOR = 3600.0  # a lost worker with no machines left is shown for an hour, then only kept

# what a rebuild must reproduce exactly: everything that comes from the stream
DUMP_QUERIES = {
    "events": "SELECT * FROM events ORDER BY stream_seq",
    "machines": "SELECT * FROM machines ORDER BY id, worker_id",
    "apps": "SELECT * FROM apps ORDER BY name",
    "workers": "SELECT worker_id, region, last_event FROM workers WHERE last_event IS NOT NULL ORDER BY worker_id",
    "meta": "SELECT * FROM meta WHERE key = 'last_seq'",
}

_info_decoder = msgspec.json.Decoder(WorkerInfo)


class ViewReader:
    """Answers from the view's file: what `status` prints and the live screen draws."""

    def __init__(self, db: ViewDb) -> None:
        self.db = db

    def known_app(self, app: str) -> bool:
        """Whether any event of `app` was ever applied (an unknown app is worth a note, not an error)."""
        return self.db.conn.execute("SELECT 1 FROM apps WHERE name = ?", (app,)).fetchone() is not None

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
        with self.db.read():
            workers = self._workers(now, ttl, app)
            rows = self._machines(app, include_destroyed) if machines else []
            rows = _with_host_status(rows, workers)
            groups = self._groups(app)
            tail = self._events(app, events)
            apps = [row[0] for row in self.db.conn.execute("SELECT name FROM apps ORDER BY name")]
            stream_seq = self.db.last_seq
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

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row that comes from the stream, in a fixed order: what a rebuild must reproduce."""
        return {name: self.db.conn.execute(query).fetchall() for name, query in DUMP_QUERIES.items()}

    def _machines(self, app: str | None, include_destroyed: bool) -> list[MachineRow]:
        rows = _named(
            self.db.conn.execute(
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
        rows = self.db.conn.execute(
            "SELECT region, app, state, role, count(*) FROM machines WHERE state != 'destroyed' "
            "AND (? IS NULL OR app = ?) GROUP BY region, app, state, role ORDER BY region, app, state, role",
            (app, app),
        )
        return [MachineGroup(region=r, app=a, state=s, role=role, count=n) for r, a, s, role, n in rows]

    def _workers(self, now: float, ttl: float, app: str | None) -> list[WorkerRow]:
        held = dict(
            self.db.conn.execute(
                "SELECT worker_id, count(*) FROM machines WHERE state != 'destroyed' AND (? IS NULL OR app = ?) "
                "GROUP BY worker_id",
                (app, app),
            ).fetchall()
        )
        rows = self.db.conn.execute(
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
                    address=info.address if info else "",
                )
            )
        return out

    def _events(self, app: str | None, limit: int) -> list[EventRow]:
        if limit <= 0:
            return []
        rows = _named(
            self.db.conn.execute(
                "SELECT stream_seq, timestamp, region, worker_id, app, machine_id, type, status, from_state, reason "
                "FROM events WHERE (? IS NULL OR app = ?) ORDER BY stream_seq DESC LIMIT ?",
                (app, app, limit),
            )
        )
        return [EventRow(**row) for row in reversed(rows)]


def _named(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    """Rows as dicts keyed by column name (the columns are named as the record fields they fill)."""
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _with_host_status(rows: list[MachineRow], workers: list[WorkerRow]) -> list[MachineRow]:
    """A machine on a worker that stopped beating is as its worker last said, on a host we cannot reach
    (Fly's `host_status`): its state and checks are the last known, not the present."""
    reachable = {w.worker_id for w in workers if w.status != LOST}
    return [
        row if row.worker_id in reachable else msgspec.structs.replace(row, host_status=UNREACHABLE) for row in rows
    ]


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
