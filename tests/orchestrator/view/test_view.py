"""The systemwide view: folding events into SQLite (`fold`), reading it (`query`), rebuild rules, the live layout.

Pure parts are fed records directly; the follower runs against a real nats-server (a fresh one per
test, so stream sequences are the test's own) with events published as workers publish them.
"""

from __future__ import annotations

import asyncio
import io
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.cells import cell_len
from rich.console import Console

from bus.contract import subjects
from bus.contract.errors import BadRequest
from bus.contract.fleet import WorkerInfo
from bus.contract.machines import CheckStatus, ExitInfo, MachineEvent
from bus.contract.offers import Resources
from bus.local.embedded import EmbeddedNats
from bus.transport.jetstream import FleetConfig, ensure_fleet_resources, events_limits, parse_size
from orchestrator.cli.view_render import layout
from orchestrator.view.db import ViewDb
from orchestrator.view.fold import StreamIdentity, ViewWriter, needs_rebuild
from orchestrator.view.follower import ViewFollower
from orchestrator.view.history import parse_since
from orchestrator.view.paths import default_view_path
from orchestrator.view.query import ViewReader
from tests.helpers import arun, connect_nats

M1, M2, M3 = "a" * 14, "b" * 14, "c" * 14
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def event(
    seq: int,
    status: str,
    machine: str = M1,
    *,
    kind: str = "transition",
    worker: str = "mad-w1",
    region: str = "mad",
    app: str = "web",
    **fields: Any,
) -> MachineEvent:
    values: dict[str, Any] = {
        "type": kind,
        "status": status,
        "seq": seq,
        "machine_id": machine,
        "app": app,
        "region": region,
        "worker_id": worker,
        "timestamp": 1_700_000_000_000.0 + seq,
    }
    return MachineEvent(**values, **fields)


def info(worker: str, region: str = "mad", *, heartbeat_at: float, cordoned: bool = False, used: int = 1) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker,
        region=region,
        capacity=Resources(cpus=4, memory_mb=4096),
        used=Resources(cpus=used, memory_mb=256 * used),
        machines=used,
        cordoned=cordoned,
        heartbeat_at=heartbeat_at,
    )


@pytest.fixture
def db() -> Iterator[ViewDb]:
    view = ViewDb(":memory:")
    yield view
    view.close()


@pytest.fixture
def fold(db: ViewDb) -> ViewWriter:
    return ViewWriter(db)


@pytest.fixture
def query(db: ViewDb) -> ViewReader:
    return ViewReader(db)


# ---------------------------------------------------------------------------------------------------
# folding events


def test_a_machine_follows_its_workers_sequence_not_arrival_order(fold: ViewWriter, query: ViewReader) -> None:
    # stream order 1, 2, 3 carries worker sequences 1, 5, 3: the event from seq 3 arrived late
    fold.apply_events(
        [
            (1, event(1, "created")),
            (2, event(5, "started", from_state="starting")),
            (3, event(3, "starting", from_state="created")),
        ]
    )
    [machine] = query.snapshot(time.time()).machines
    assert (machine.state, machine.version) == ("started", 5)
    assert [e.status for e in query.snapshot(time.time()).events] == ["created", "started", "starting"]


def test_applying_an_event_twice_is_a_no_op(fold: ViewWriter, query: ViewReader) -> None:
    batch: list[tuple[int, MachineEvent | None]] = [
        (1, event(1, "created")),
        (2, event(2, "starting")),
        (3, None),
        (4, event(3, "started")),
    ]
    assert fold.apply_events(batch) == 4
    before = query.dump()
    assert fold.apply_events(batch) == 0
    assert fold.apply_events(batch[1:2]) == 0
    assert query.dump() == before and query.db.last_seq == 4


def test_release_role_checks_and_exit_come_from_the_events(fold: ViewWriter, query: ViewReader) -> None:
    labels = {"fauxmad_release": "7", "fauxmad_role": "spare"}
    fold.apply_events(
        [
            (1, event(1, "created", metadata=labels)),
            (2, event(2, "started")),
            (3, event(3, "started", kind="check", check=CheckStatus(name="http", status="passing"))),
            (4, event(4, "started", kind="check", check=CheckStatus(name="tcp", status="critical"))),
        ]
    )
    [machine] = query.snapshot(time.time()).machines
    assert (machine.release, machine.role) == ("7", "spare")
    assert machine.checks == {"http": "passing", "tcp": "critical"} and machine.check_status == "critical"
    fold.apply_events(
        [
            (5, event(5, "started", kind="update", metadata={"fauxmad_release": "8", "fauxmad_role": "primary"})),
            (6, event(6, "started", kind="exit", exit=ExitInfo(exit_code=3))),
            (7, event(6, "failed", from_state="started")),
            (8, event(1, "created", metadata=labels)),  # a stale copy of the first event changes nothing
        ]
    )
    [machine] = query.snapshot(time.time()).machines
    assert (machine.state, machine.release, machine.role, machine.exit_code) == ("failed", "8", "primary", 3)
    assert machine.checks == {} and machine.check_status == ""


def test_each_worker_owns_its_rows_even_for_a_machine_id_seen_on_two_workers(
    fold: ViewWriter, query: ViewReader
) -> None:
    # a reserve that timed out on mad-w1 but landed, retried with the same id on mad-w2 which won
    fold.apply_events(
        [
            (1, event(7, "created", worker="mad-w1")),
            (2, event(3, "created", worker="mad-w2")),
            (3, event(4, "started", worker="mad-w2")),
            (4, event(8, "destroyed", worker="mad-w1")),
        ]
    )
    now = time.time()
    assert [(m.worker_id, m.state) for m in query.snapshot(now).machines] == [("mad-w2", "started")]
    everything = query.snapshot(now, include_destroyed=True).machines
    assert sorted((m.worker_id, m.state) for m in everything) == [("mad-w1", "destroyed"), ("mad-w2", "started")]


def test_destroyed_machines_leave_the_listing_and_apps_are_known(fold: ViewWriter, query: ViewReader) -> None:
    fold.apply_events(
        [(1, event(1, "created")), (2, event(2, "created", M2, app="api")), (3, event(3, "destroyed", M2, app="api"))]
    )
    now = time.time()
    assert [m.id for m in query.snapshot(now).machines] == [M1]
    assert {m.id for m in query.snapshot(now, include_destroyed=True).machines} == {M1, M2}
    assert query.snapshot(now, app="api").machines == [] and query.known_app("api")
    assert not query.known_app("nope") and query.snapshot(now, app="nope").workers == []


def test_a_view_without_history_keeps_the_same_state_and_no_row_per_event() -> None:
    """The console's view (`history=False`): machines, apps and workers folded exactly as with history, no event
    rows, and a file that stays the same size however many events its machines go through."""
    events = [
        (n, event(n, status, machine))
        for n, (status, machine) in enumerate(
            [("created", M1), ("created", M2), ("started", M1), ("started", M2), ("stopped", M2)], start=1
        )
    ]
    full, bare = ViewDb(":memory:"), ViewDb(":memory:")
    try:
        ViewWriter(full).apply_events(events)
        lean = ViewWriter(bare, history=False)
        lean.apply_events(events)
        kept, without = ViewReader(full).dump(), ViewReader(bare).dump()
        assert without["events"] == [] and len(kept["events"]) == 5
        assert {k: v for k, v in kept.items() if k != "events"} == {k: v for k, v in without.items() if k != "events"}

        def pages() -> int:
            return int(bare.conn.execute("PRAGMA page_count").fetchone()[0])

        churn = [(6 + n, event(6 + n, ("stopped", "started")[n % 2], M1)) for n in range(5000)]
        lean.apply_events(churn[:100])
        before = pages()
        lean.apply_events(churn[100:])
        assert pages() == before  # 4,900 more events, not one more page
        assert ViewReader(bare).snapshot(0.0).machines[0].state == "started"
    finally:
        full.close()
        bare.close()


def test_heartbeats_expiry_and_staleness_set_worker_status(fold: ViewWriter, query: ViewReader) -> None:
    now = time.time()
    fold.put_heartbeat("mad.mad-w1", info("mad-w1", heartbeat_at=now), now)
    fold.put_heartbeat("mad.mad-w2", info("mad-w2", heartbeat_at=now, cordoned=True), now)
    fold.put_heartbeat("syd.syd-w1", info("syd-w1", "syd", heartbeat_at=now), now)
    fold.apply_events([(1, event(1, "started", worker="syd-w1", region="syd"))])
    status = {w.worker_id: w.status for w in query.snapshot(now).workers}
    assert status == {"mad-w1": "ready", "mad-w2": "cordoned", "syd-w1": "ready"}
    fold.put_heartbeat("mad.mad-w1", None, now)  # an expiry marker
    fold.lost_unless({"mad.mad-w2"}, now)  # a fresh read of the bucket without syd-w1
    snap = query.snapshot(now)
    assert {w.worker_id: w.status for w in snap.workers} == {"mad-w1": "lost", "mad-w2": "cordoned", "syd-w1": "lost"}
    regions = {r.region: r for r in snap.regions}
    assert (regions["mad"].workers, regions["mad"].lost, regions["mad"].cordoned) == (1, 1, 1)
    assert (regions["syd"].workers, regions["syd"].lost, regions["syd"].machines) == (0, 1, 1)
    # a heartbeat older than the TTL counts as lost even before its marker arrives
    assert {w.status for w in query.snapshot(now + 60).workers} == {"lost"}
    # long gone and holding nothing: no longer listed; holding a machine: still listed
    assert {w.worker_id for w in query.snapshot(now + 7200).workers} == {"syd-w1"}


def test_status_json_shape_is_stable(fold: ViewWriter, query: ViewReader) -> None:
    now = time.time()
    fold.put_heartbeat("mad.mad-w1", info("mad-w1", heartbeat_at=now), now)
    fold.apply_events([(1, event(1, "created"))])
    shape = msgspec.json.decode(msgspec.json.encode(query.snapshot(now).status_json("/tmp/v")))
    assert list(shape) == ["regions", "workers", "machines", "view"]
    assert set(shape["regions"][0]) == {
        "region",
        "workers",
        "cordoned",
        "lost",
        "capacity",
        "used",
        "machines",
        "states",
    }
    assert set(shape["workers"][0]) == {
        "worker_id",
        "region",
        "status",
        "capacity",
        "used",
        "machines",
        "cordoned",
        "load",
        "heartbeat_at",
        "states",
        "address",  # addition (hosts): where other hosts reach the worker
    }
    assert set(shape["machines"][0]) == {
        "id",
        "app",
        "region",
        "worker_id",
        "state",
        "release",
        "role",
        "checks",
        "check_status",
        "exit_code",
        "version",
        "updated_at",
        "host_status",
    }
    assert shape["view"] == {"path": "/tmp/v", "stream_seq": 1, "taken_at": now}


# ---------------------------------------------------------------------------------------------------
# rebuild rules, inputs, configuration


def test_a_view_is_rebuilt_when_it_cannot_continue_on_the_stream() -> None:
    assert needs_rebuild(StreamIdentity(created="", last_seq=0), 5, 9, "t1") is None
    assert needs_rebuild(StreamIdentity(created="t1", last_seq=9), 5, 9, "t1") is None
    assert needs_rebuild(StreamIdentity(created="t1", last_seq=4), 5, 9, "t1") is None  # the very next is there
    assert "aged out" in str(needs_rebuild(StreamIdentity(created="t1", last_seq=3), 5, 9, "t1"))
    assert "recreated" in str(needs_rebuild(StreamIdentity(created="t1", last_seq=3), 1, 9, "t2"))
    assert "ends at" in str(needs_rebuild(StreamIdentity(created="", last_seq=30), 1, 9, "t2"))


def test_since_parses_durations_and_times() -> None:
    now = 1_700_000_000.0
    assert parse_since("10m", now) == now - 600
    assert parse_since("30s", now) == now - 30
    assert parse_since("2h", now) == now - 7200
    assert parse_since("1d", now) == now - 86400
    assert parse_since("45", now) == now - 45
    assert parse_since("2024-05-01T12:00:00Z", now) == datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp()
    assert parse_since("2024-05-01T14:00:00+02:00", now) == datetime(2024, 5, 1, 12, tzinfo=UTC).timestamp()
    assert parse_since("2024-05-01T12:00:00", now) == datetime(2024, 5, 1, 12).astimezone().timestamp()
    for bad in ("yesterday", "-5m", "10 minutes", "", "5x"):
        with pytest.raises(ValueError, match="invalid --since"):
            parse_since(bad, now)


def test_event_filters_limits_and_view_location() -> None:
    assert subjects.events_filter() == "fauxmad.v1.events.*.*.*.*"
    assert subjects.events_filter("web", M1) == f"fauxmad.v1.events.*.*.web.{M1}"
    assert subjects.events_filter(machine_id=M1) == f"fauxmad.v1.events.*.*.*.{M1}"
    with pytest.raises(BadRequest, match="invalid app"):
        subjects.events_filter("we.b")
    env = {"FAUXMAD_EVENTS_MAX_AGE": "2h", "FAUXMAD_EVENTS_MAX_BYTES": "64MiB"}
    limits = events_limits(FleetConfig(), env)
    assert (limits.max_age, limits.max_bytes, limits.explicit) == (7200.0, 64 << 20, True)
    assert events_limits(FleetConfig(events_max_age=60.0), env).max_age == 60.0
    assert not events_limits(FleetConfig(), {}).explicit
    assert parse_size("1GB") == 10**9 and parse_size("512") == 512
    with pytest.raises(ValueError, match="events stream limits"):
        events_limits(FleetConfig(), {"FAUXMAD_EVENTS_MAX_AGE": "soon"})
    url = "nats://127.0.0.1:4222"
    assert default_view_path(url, {"FAUXMAD_VIEW": "/x/v.sqlite"}) == Path("/x/v.sqlite")
    assert default_view_path(url, {"XDG_CACHE_HOME": "/c"}).parent == Path("/c/fauxmad")
    assert default_view_path(url, {"FAUXMAD_HOME": "/h"}).parent == Path("/h/cache")
    assert default_view_path(url, {"HOME": "/u"}) != default_view_path("nats://other:4222", {"HOME": "/u"})


def test_a_corrupt_view_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "view.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    db = ViewDb(path)
    assert db.last_seq == 0 and ViewWriter(db).apply_events([(1, event(1, "created"))]) == 1
    db.close()


# ---------------------------------------------------------------------------------------------------
# the live layout: pure, rendered at several widths


def fleet_view() -> ViewDb:
    db = ViewDb(":memory:")
    view = ViewWriter(db)
    now = time.time()
    batch: list[tuple[int, MachineEvent | None]] = []
    for r, region in enumerate(("mad", "syd", "gru")):
        for w in range(3):
            worker = f"{region}-w{w + 1}"
            view.put_heartbeat(
                f"{region}.{worker}", info(worker, region, heartbeat_at=now, used=w + 1, cordoned=(r, w) == (1, 2)), now
            )
            for n, app in enumerate(("web", "api-with-a-long-name")):
                machine = f"{r}{w}{n}".ljust(14, "0")
                role = {"fauxmad_role": "spare" if n and w == 2 else "primary", "fauxmad_release": "3"}
                seq = len(batch) + 1
                batch.append(
                    (seq, event(seq, "created", machine, worker=worker, region=region, app=app, metadata=role))
                )
                if not (n and w == 2):
                    batch.append(
                        (
                            seq + 1,
                            event(
                                seq + 1,
                                "started",
                                machine,
                                worker=worker,
                                region=region,
                                app=app,
                                from_state="starting",
                                reason="process 4242 running " * 4,
                            ),
                        )
                    )
    view.apply_events(batch)
    return db


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_live_layout_fits_and_shows_the_fleet(width: int) -> None:
    db = fleet_view()
    snap = ViewReader(db).snapshot(time.time(), events=30, machines=False)
    console = Console(file=io.StringIO(), width=width, height=40, force_terminal=True, color_system="truecolor")
    console.print(layout(snap, width=width, height=40, source="nats://127.0.0.1:4222"))
    lines = ANSI.sub("", console.file.getvalue()).splitlines()  # type: ignore[attr-defined]
    assert lines and max(cell_len(line) for line in lines) <= width
    text = "\n".join(lines)
    assert "3 regions · workers 8 ready, 1 cordoned" in text
    assert "machines 18: 15 started 3 created · spares 3" not in text  # spares are not counted as machines twice
    assert "machines 15: 15 started · spares 3" in text
    for region in ("mad", "syd", "gru"):
        panel_title = next(line for line in lines if f"{region} " in line and "workers" in line)
        assert "cpu 6/12" in panel_title
        for w in range(3):
            row = next(line for line in lines if f"{region}-w{w + 1} " in line and "cpu" in line)
            assert "mem" in row and re.search(r"[█░]{6}", row), row  # the bars share the worker's line
    assert "cordoned" in next(line for line in lines if "syd-w3" in line)
    assert any("web" in line and "3 started" in line for line in lines)
    assert any("spares 1" in line for line in lines)
    assert "recent events" in text and "starting→started" in text
    assert sum("recent events" in line for line in lines) == 1
    if width >= 160:  # region panels side by side
        assert any(line.count("╭") >= 2 for line in lines)
    db.close()


def test_the_live_layout_of_an_empty_fleet() -> None:
    db = ViewDb(":memory:")
    console = Console(file=io.StringIO(), width=80, force_terminal=True)
    console.print(layout(ViewReader(db).snapshot(time.time(), machines=False), width=80, source="nats://x"))
    text = ANSI.sub("", console.file.getvalue())  # type: ignore[attr-defined]
    assert "no workers have reported yet" in text and "no events yet" in text
    db.close()


# ---------------------------------------------------------------------------------------------------
# the follower against a real stream


def synthetic(machines: int, per_machine: int, workers: int) -> list[tuple[str, bytes]]:
    """Events as workers publish them: per worker, in its own sequence; workers interleaved."""
    states = ["created", "starting", "started", "stopping", "stopped"]
    seqs = [0] * workers
    out = []
    for round_ in range(per_machine):
        for m in range(machines):
            w = m % workers
            seqs[w] += 1
            status = states[round_ % len(states)]
            machine = f"{m:014x}"
            ev = event(
                seqs[w],
                status,
                machine,
                worker=f"w{w}",
                region=f"r{w % 3}",
                app=f"app{m % 7}",
                from_state=states[(round_ - 1) % len(states)] if round_ else None,
            )
            out.append((subjects.events(ev.region, ev.worker_id, ev.app, machine), msgspec.json.encode(ev)))
    return out


async def publish(url: str, messages: list[tuple[str, bytes]]) -> int:
    nc = await connect_nats(url)
    js = nc.jetstream()
    await ensure_fleet_resources(js, FleetConfig(storage="memory"))
    for subject, data in messages:
        await nc.publish(subject, data)
    await nc.flush()
    for _ in range(200):
        last = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
        if last >= len(messages):
            break
        await asyncio.sleep(0.01)
    await nc.close()
    return int(last)


async def build(url: str, path: Path) -> tuple[ViewFollower, float]:
    nc = await connect_nats(url)
    db = ViewDb(path)
    follower = ViewFollower(nc, ViewWriter(db))
    started = time.perf_counter()
    await follower.start(heartbeats=False)
    assert await follower.catch_up(60)
    elapsed = time.perf_counter() - started
    await follower.close()
    db.close()
    await nc.close()
    return follower, elapsed


def test_catch_up_rate_and_rebuild_from_scratch(fresh_nats: EmbeddedNats, tmp_path: Path) -> None:
    messages = synthetic(machines=500, per_machine=20, workers=10)
    assert arun(publish(fresh_nats.url, messages)) == 10_000
    first, elapsed = arun(build(fresh_nats.url, tmp_path / "a.sqlite"))
    print(f"\nview catch-up: {first.applied} events in {elapsed:.2f}s = {first.applied / elapsed:,.0f} events/s")
    assert first.applied == 10_000
    (tmp_path / "a.sqlite").rename(tmp_path / "kept.sqlite")  # delete the file: it is rebuilt from the stream
    _, elapsed = arun(build(fresh_nats.url, tmp_path / "a.sqlite"))
    print(f"rebuild after deleting the file: {elapsed:.2f}s")
    kept, rebuilt = ViewDb(tmp_path / "kept.sqlite"), ViewDb(tmp_path / "a.sqlite")
    assert ViewReader(kept).dump() == ViewReader(rebuilt).dump()
    snap = ViewReader(rebuilt).snapshot(time.time())
    assert len(snap.machines) == 500 and {m.state for m in snap.machines} == {"stopped"}
    kept.close()
    rebuilt.close()


def test_resume_applies_only_new_events_and_stale_views_are_rebuilt(fresh_nats: EmbeddedNats, tmp_path: Path) -> None:
    path = tmp_path / "v.sqlite"
    messages = synthetic(machines=10, per_machine=5, workers=2)
    arun(publish(fresh_nats.url, messages[:30]))
    first, _ = arun(build(fresh_nats.url, path))
    assert (first.applied, first.first_applied, first.rebuilt) == (30, 1, None)
    arun(publish(fresh_nats.url, messages[30:]))
    resumed, _ = arun(build(fresh_nats.url, path))
    assert (resumed.applied, resumed.first_applied, resumed.rebuilt) == (20, 31, None)

    async def purge_and_add() -> None:  # events 51..55 arrive, then 1..52 age out: the view (at 50) missed 51
        await publish(fresh_nats.url, synthetic(machines=5, per_machine=1, workers=1))
        nc = await connect_nats(fresh_nats.url)
        await nc.jetstream().purge_stream(subjects.EVENTS_STREAM, seq=53)
        await nc.close()

    arun(purge_and_add())
    aged, _ = arun(build(fresh_nats.url, path))
    assert "aged out" in str(aged.rebuilt) and aged.applied == 3 and aged.first_applied == 53
    db = ViewDb(path)
    assert [row[0] for row in ViewReader(db).dump()["events"]] == [53, 54, 55]
    db.close()

    async def recreate() -> None:
        nc = await connect_nats(fresh_nats.url)
        await nc.jetstream().delete_stream(subjects.EVENTS_STREAM)
        await nc.close()
        await publish(fresh_nats.url, messages[:4])

    arun(recreate())
    fresh, _ = arun(build(fresh_nats.url, path))
    assert "recreated" in str(fresh.rebuilt) and fresh.applied == 4


def test_stream_limits_are_configuration_applied_to_an_existing_stream(
    fresh_nats: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def limits(config: FleetConfig) -> tuple[float, int]:
        nc = await connect_nats(fresh_nats.url)
        js = nc.jetstream()
        await ensure_fleet_resources(js, config)
        stream = (await js.stream_info(subjects.EVENTS_STREAM)).config
        await nc.close()
        return stream.max_age or 0.0, stream.max_bytes or 0

    assert arun(limits(FleetConfig())) == (7 * 86400.0, 1 << 30)  # the defaults
    monkeypatch.setenv("FAUXMAD_EVENTS_MAX_AGE", "2h")
    monkeypatch.setenv("FAUXMAD_EVENTS_MAX_BYTES", "64MiB")
    assert arun(limits(FleetConfig())) == (7200.0, 64 << 20)  # given: applied to the stream that exists
    assert arun(limits(FleetConfig(events_max_age=600.0))) == (600.0, 64 << 20)
    monkeypatch.delenv("FAUXMAD_EVENTS_MAX_AGE")
    monkeypatch.delenv("FAUXMAD_EVENTS_MAX_BYTES")
    assert arun(limits(FleetConfig())) == (600.0, 64 << 20)  # not given: the stream keeps what it has
