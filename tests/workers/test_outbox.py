"""The worker's outbox across NATS outages and worker restarts: real nats-server, real worker process.

The routing index (KV `fauxmad_machines`) and the history (stream `FAUXMAD_EVENTS`) must converge on
the worker's log after any outage: nothing dropped, nothing doubled (`Nats-Msg-Id`).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.js.errors import NotFoundError

from bus.contract.machines import Machine, MachineConfig, MachineEvent
from bus.local.embedded import EmbeddedNats
from bus.local.ports import free_port
from bus.transport.jetstream import ensure_fleet_resources
from tests.helpers import RawClient, WorkerProcess, arun, until, wait_until
from workers.log.records import MachineRecord, StoredMachine, newest_events
from workers.log.store import Store
from workers.outbox import NOTHING, Outbox, event_msg_id, missing, parse_msg_id, record_events, with_n

STREAM = "FAUXMAD_EVENTS"
EXITS_SOON = ["sh", "-c", "sleep 1.5; exit 3"]  # exits by itself while NATS is down: failed
ENDS_SOON = ["sh", "-c", "sleep 3; exit 0"]  # ends by itself while NATS is down: stopped
SLEEPER = ["sleep", "60"]


@pytest.fixture
def crashable_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server with its own store and a fixed port, so `kill()` then `start()` is a crash and a restart."""
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=free_port(), name="fauxmad-test-outage").start()
    yield server
    server.stop()


class Converged(msgspec.Struct):
    machines: dict[str, Any]  # id -> the worker's view (get, with events)
    index: dict[str, Any]  # id -> KV fauxmad_machines entry
    stream: list[tuple[str, Any]]  # (Nats-Msg-Id, event) of this worker, in stream order


async def stream_events(js: Any, worker_id: str) -> list[tuple[str, Any]]:
    """Every event of `worker_id` in the stream, oldest first, with its `Nats-Msg-Id`."""
    found: list[tuple[str, Any]] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(STREAM, seq=seq, subject=f"fauxmad.v1.events.*.{worker_id}.*.*", next=True)
        except NotFoundError:
            return found
        found.append(((msg.headers or {}).get("Nats-Msg-Id", ""), msgspec.json.decode(msg.data)))
        seq = msg.seq + 1


def event_key(event: Any) -> tuple[str, int, str, str]:
    return event["machine_id"], event["seq"], event["type"], event["status"]


async def observe(nc: Any, worker: WorkerProcess, ids: list[str]) -> Converged:
    raw = RawClient(nc, worker.worker_id)
    js = nc.jetstream()
    kv = await js.key_value("fauxmad_machines")
    machines = {mid: await raw.ok("get", {"id": mid, "events": True}) for mid in ids}
    index: dict[str, Any] = {}
    for mid in ids:
        try:
            index[mid] = msgspec.json.decode((await kv.get(mid)).value or b"null")
        except Exception:
            index[mid] = None
    return Converged(machines=machines, index=index, stream=await stream_events(js, worker.worker_id))


def problems(seen: Converged) -> list[str]:
    """What keeps the index and the stream from matching the worker's log (empty: converged)."""
    out = []
    for mid, machine in seen.machines.items():
        entry = seen.index[mid]
        if entry is None or (entry["state"], entry["version"]) != (machine["state"], machine["version"]):
            out.append(
                f"index of {mid}: {entry and (entry['state'], entry['version'])} != "
                f"{(machine['state'], machine['version'])}"
            )
        in_stream = {event_key(event) for _, event in seen.stream}
        missing = [event_key(e) for e in machine["events"] if event_key(e) not in in_stream]
        if missing:
            out.append(f"stream lacks {missing}")
    doubled = [key for key, count in Counter(event_key(e) for _, e in seen.stream).items() if count > 1]
    if doubled:
        out.append(f"stream has duplicates {doubled}")
    return out


async def converge(url: str, worker: WorkerProcess, ids: list[str], within: float) -> tuple[Converged, float]:
    """Poll until the index and the stream match the worker; the observation and the seconds it took."""
    nc = await nats.connect(url)
    started = time.monotonic()
    try:
        while True:
            try:
                seen = await observe(nc, worker, ids)
                trouble = problems(seen)
            except Exception as exc:  # the worker (or JetStream) is not back yet
                trouble = [repr(exc)]
            if not trouble:
                return seen, time.monotonic() - started
            if time.monotonic() - started > within:
                log = worker.log_path.read_text(errors="replace")[-3000:]
                raise AssertionError(f"not converged within {within}s: {trouble}\nworker log:\n{log}")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def place(
    url: str, worker: WorkerProcess, cmds: list[list[str]], restart: dict[str, Any] | None = None
) -> list[str]:
    """Reserve and start one machine per command (restart policy `no` unless given); their ids."""
    nc = await nats.connect(url)
    try:
        raw = RawClient(nc, worker.worker_id)
        ids = []
        for i, cmd in enumerate(cmds):
            machine = await raw.ok(
                "reserve",
                {
                    "app": "outage",
                    "region": worker.region,
                    "name": f"m{i}",
                    "config": {"cmd": cmd, "restart": restart or {"policy": "no"}},
                },
            )
            await raw.ok("start", {"id": machine["id"]})
            ids.append(machine["id"])
        return ids
    finally:
        await nc.close()


def recorded(worker: WorkerProcess, ids: list[str], done: Callable[[StoredMachine], bool], what: str) -> None:
    """Until the worker's log holds `done` of every machine: read from its LMDB beside the running worker
    (NATS may be down, so the worker cannot be asked)."""
    store = Store(worker.data_dir / "lmdb")
    try:
        wait_until(lambda: all((m := store.get(mid)) is not None and done(m) for mid in ids), what, timeout=15)
    finally:
        store.close()


def exits(stored: StoredMachine) -> int:
    return sum(event.type == "exit" for event in stored.events)


async def index_revisions(url: str, ids: list[str]) -> dict[str, int]:
    """The revision of each machine's entry in the index (KV `fauxmad_machines`)."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value("fauxmad_machines")
        return {mid: (await kv.get(mid)).revision or 0 for mid in ids}
    finally:
        await nc.close()


async def republished(url: str, ids: list[str], before: dict[str, int]) -> None:
    """Until a restarted worker's start-up republish went out: it puts every machine's index entry again,
    in its first delivery, with whatever events the stream lacked (nothing is delivered before the
    look-ups are done), so each entry's revision passes the one read while the worker was down."""

    async def put_again() -> bool:
        now = await index_revisions(url, ids)
        return all(now[mid] > before[mid] for mid in ids)

    await until(put_again, "the restarted worker republished its machines' index entries", timeout=15)


def a_machine(machine_id: str, name: str, app: str, region: str, worker_id: str, state: str, version: int) -> Machine:
    """A machine record as a worker's log holds it, with what the outbox reads and nothing else."""
    return Machine(
        id=machine_id,
        name=name,
        app=app,
        region=region,
        worker_id=worker_id,
        state=state,
        config=MachineConfig(),
        instance_id="i",
        created_at="",
        updated_at="",
        version=version,
    )


@pytest.mark.parametrize("outage", ["killed", "hung then killed"])
def test_index_and_events_converge_after_a_nats_outage(
    outage: str, crashable_nats: EmbeddedNats, worker_factory: Callable[..., WorkerProcess]
) -> None:
    """Both machines exit while NATS is away, for longer than any request timeout.

    `killed`: the worker sees the connection drop at once. `hung then killed`: the server stops
    answering first, so for a while the worker writes into a connection that is already dead (what a
    network partition does), and whatever it wrote there is lost with the server.
    """
    server = crashable_nats
    worker = worker_factory(url=server.url)
    ids = arun(place(server.url, worker, [EXITS_SOON, ENDS_SOON, SLEEPER]))
    arun(converge(server.url, worker, ids, within=5))

    # the outage is the scenario, not a wait: it spans both exits (1.5 s and 3 s into the machines' lives)
    # and then outlasts the outbox's 3 s ack timeout, so what was sent into it is known lost
    if outage == "killed":
        server.kill()
        time.sleep(6.5)
    else:
        assert server.process is not None
        server.process.send_signal(signal.SIGSTOP)
        time.sleep(6.5)
        server.kill()
    server.start()

    seen, took = arun(converge(server.url, worker, ids, within=8))
    print(f"converged {took:.2f}s after nats-server restarted")
    states = [seen.machines[mid]["state"] for mid in ids]
    assert states == ["failed", "stopped", "started"]
    for mid in ids[:2]:  # the transitions made during the outage are in the stream, once each
        statuses = [e["status"] for _, e in seen.stream if e["machine_id"] == mid and e["type"] == "transition"]
        assert statuses == ["created", "starting", "started", seen.machines[mid]["state"]]
        exits = [e for _, e in seen.stream if e["machine_id"] == mid and e["type"] == "exit"]
        assert len(exits) == 1
    for msg_id, event in seen.stream:  # every event carries its stable id
        assert parse_msg_id(msg_id) is not None and msg_id.startswith(f"{worker.worker_id}:{event['machine_id']}:")
    log = worker.log_path.read_text()
    assert log.count("NATS is not taking deliveries") == 1, log[-3000:]  # one warning per outage, not per item
    assert log.count("NATS takes deliveries again") == 1, log[-3000:]


def test_a_worker_that_dies_during_the_outage_republishes_on_start(
    crashable_nats: EmbeddedNats, worker_factory: Callable[..., WorkerProcess]
) -> None:
    """What the outbox held in memory dies with the worker: the start-up republish restores the newest."""
    server = crashable_nats
    worker = worker_factory(url=server.url)
    ids = arun(place(server.url, worker, [EXITS_SOON, ENDS_SOON]))
    arun(converge(server.url, worker, ids, within=5))

    server.kill()
    # both exit, and the worker records it; then the worker dies with its outbox
    recorded(worker, ids, lambda m: m.machine.state in ("failed", "stopped"), "both machines ended in the log")
    worker.kill9()
    server.start()
    worker.start()

    seen, took = arun(converge(server.url, worker, ids, within=8))
    print(f"converged {took:.2f}s after the worker restarted")
    assert [seen.machines[mid]["state"] for mid in ids] == ["failed", "stopped"]


def test_every_record_the_dead_worker_held_comes_back_not_only_the_newest(
    crashable_nats: EmbeddedNats, worker_factory: Callable[..., WorkerProcess]
) -> None:
    """While NATS is away the machine fails, is restarted and fails again: several records, all held in
    the outbox's memory when the worker is killed. On start every one of them reaches the stream, in
    log order (a republish of the newest record alone left a gap in the history for good)."""
    server = crashable_nats
    worker = worker_factory(url=server.url)
    fails_fast = ["sh", "-c", "sleep 1; exit 3"]
    ids = arun(place(server.url, worker, [fails_fast], restart={"policy": "on-failure", "max_retries": 1}))
    arun(converge(server.url, worker, ids, within=5))

    server.kill()
    # fails, restarts after the backoff, fails again: failed for good
    recorded(worker, ids, lambda m: m.machine.state == "failed" and exits(m) == 2, "failed twice in the log")
    worker.kill9()
    server.start()
    worker.start()

    seen, took = arun(converge(server.url, worker, ids, within=8))
    print(f"converged {took:.2f}s after the worker restarted")
    machine = seen.machines[ids[0]]
    assert machine["state"] == "failed"
    records = {e["seq"] for e in machine["events"]}
    in_stream = [(e["seq"], e["type"], e["status"]) for _, e in seen.stream]
    assert in_stream == sorted(in_stream, key=lambda key: key[0])  # log order
    assert len([e for _, e in seen.stream if e["type"] == "exit"]) == 2
    assert len(records) >= 5  # created, starting, started, then at least two records during the outage


def test_worker_restarts_add_no_duplicates_and_restore_a_lost_newest_event(
    crashable_nats: EmbeddedNats, worker_factory: Callable[..., WorkerProcess]
) -> None:
    server = crashable_nats
    worker = worker_factory(url=server.url)

    async def shrink_duplicate_window() -> None:
        # the republish must not rely on the stream's duplicate window (2 minutes by default): a worker
        # restarted later than that must not double anything either. Shrunk before any event is stored:
        # nats-server (2.15.1) may keep ids stored just before a shrink for the old window (1 in ~150 here),
        # and the id of the event deleted below would then drop its restored copy as a duplicate
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        config = (await js.stream_info(STREAM)).config
        config.duplicate_window = 0.5
        await js.update_stream(config)
        await nc.close()

    arun(shrink_duplicate_window())
    ids = arun(place(server.url, worker, [SLEEPER, SLEEPER]))
    before, _ = arun(converge(server.url, worker, ids, within=5))
    time.sleep(1)  # not a wait: the events' ids leave the (shrunk) duplicate window, which must not be needed
    worker.terminate()
    revisions = arun(index_revisions(server.url, ids))
    worker.start()
    arun(republished(server.url, ids, revisions))  # the republish runs in the background: until it went out
    after, _ = arun(converge(server.url, worker, ids, within=5))
    assert [key for key, _ in after.stream] == [key for key, _ in before.stream]  # nothing added

    # an event that never reached the stream (lost with a crashed worker's memory) comes back on start
    lost_id = ids[0]

    async def forget_newest() -> tuple[str, Any]:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        last = await js.get_last_msg(STREAM, f"fauxmad.v1.events.{worker.region}.{worker.worker_id}.outage.{lost_id}")
        await js.delete_msg(STREAM, last.seq)
        await nc.close()
        return (last.headers or {})["Nats-Msg-Id"], msgspec.json.decode(last.data)

    worker.kill9()
    msg_id, newest = arun(forget_newest())
    assert newest["status"] == "started"
    assert msg_id == event_msg_id(worker.worker_id, lost_id, newest["seq"], 0)
    revisions = arun(index_revisions(server.url, ids))
    worker.start()
    arun(republished(server.url, ids, revisions))
    restored, _ = arun(converge(server.url, worker, ids, within=5))
    assert sorted(key for key, _ in restored.stream) == sorted(key for key, _ in before.stream)
    assert restored.stream[-1][0] == msg_id


def test_an_item_nats_keeps_refusing_holds_up_nothing_else(
    nats_url: str, unique: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    """In-process outbox, real nats-server: index puts to a bucket that does not exist fail forever,
    while 5,000 events (1,000 machines x 5 records) flow without waiting on the retry backoff; the
    index backlog holds one entry per machine (the newest), and the trouble is logged once."""
    worker_id, region = unique("w"), unique("r")
    machines, records = 1000, 5

    async def main() -> tuple[float, Outbox]:
        nc = await nats.connect(nats_url)
        await ensure_fleet_resources(nc.jetstream())
        outbox = Outbox(nc, worker_id=worker_id, index_bucket=unique("missing"))
        task = asyncio.create_task(outbox.run())
        started = time.monotonic()
        seq = 0
        for r in range(records):
            for m in range(machines):
                seq += 1
                machine = a_machine(
                    f"{m:014x}", f"m{m}", "flow", region, worker_id, "started" if r % 2 else "stopped", seq
                )
                event = MachineEvent(status=machine.state, seq=seq, machine_id=machine.id, worker_id=worker_id)
                outbox.committed(
                    MachineRecord(seq=seq, at=0.0, op="op", stored=StoredMachine(machine=machine, events=[event]))
                )
        js = nc.jetstream()
        subject = f"fauxmad.v1.events.{region}.{worker_id}.>"

        async def stored() -> int:  # `state.messages` counts the whole stream: sum the filtered subjects
            return sum(((await js.stream_info(STREAM, subjects_filter=subject)).state.subjects or {}).values())

        async def all_stored() -> bool:
            return await stored() >= machines * records

        await until(all_stored, "every event stored although the index entries were refused (held up by them?)")
        took = time.monotonic() - started
        await asyncio.sleep(0.3)  # not a wait: nothing more may arrive (no event doubled)
        assert await stored() == machines * records
        task.cancel()
        await nc.close()
        return took, outbox

    took, outbox = arun(main())
    print(f"{machines * records} events delivered in {took:.2f}s beside a refused index")
    assert outbox.pending == machines  # the index backlog: one (the newest) entry per machine
    assert outbox.delivered == machines * records
    warnings = [r for r in caplog.records if "NATS is not taking deliveries" in r.getMessage()]
    assert len(warnings) == 1


def test_after_a_reconnect_an_entry_acked_in_a_round_still_in_flight_goes_again(
    nats_url: str, unique: Callable[[str], str]
) -> None:
    """The routing index is not fsync'd per write on one server, so a killed server may lose an entry it had
    acked. After the connection comes back every machine's entry goes again, also one whose ack came in a round
    that was still waiting for the rest of its acks when the connection came back (that round then counts it
    delivered). Real nats-server, in-process outbox: the machine's event is taken by a subscriber that never
    answers, so its round waits out the timeout while the index entry is acked; the entry is then purged (the
    lost write) and the reconnect counted. Without re-queueing it, the round drops it and the bucket keeps
    nothing."""
    worker_id, region, bucket = unique("w"), unique("r"), unique("idx")

    async def main() -> Any:
        from nats.js.api import KeyValueConfig

        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket=bucket, history=1))
        silent = await nc.subscribe(f"fauxmad.v1.events.{region}.>")  # takes the event, never acks it
        machine = a_machine("00000000000001", "m", "reidx", region, worker_id, "created", 1)
        outbox = Outbox(nc, worker_id=worker_id, index_bucket=bucket, timeout=2.0, machines=lambda: [machine])
        task = asyncio.create_task(outbox.run())
        event = MachineEvent(status="created", seq=1, machine_id=machine.id, worker_id=worker_id)
        outbox.committed(
            MachineRecord(seq=1, at=0.0, op="reserve", stored=StoredMachine(machine=machine, events=[event]))
        )

        async def stored() -> Any:
            try:
                return await kv.get(machine.id)
            except Exception:
                return None

        await until(stored, "the index entry acked (its round still waits for the event's ack)", timeout=1.5)
        await kv.purge(machine.id)  # what a killed server that had acked it without an fsync loses
        nc.stats["reconnects"] += 1  # the connection came back (to the restarted server)
        found = await until(stored, "the entry put again after the reconnect", timeout=10)
        task.cancel()
        await silent.unsubscribe()
        await nc.close()
        return found

    entry = msgspec.json.decode(arun(main()).value)
    assert entry["id"] == "00000000000001" and entry["worker_id"] == worker_id


def test_our_connection_tells_the_outbox_it_is_back_without_a_poll(
    crashable_nats: EmbeddedNats, unique: Callable[[str], str]
) -> None:
    """On our `Connection` the outbox does not look at the reconnect counter five times a second (a timer per
    logical worker: issue 44's simulated fleet); the connection tells it (`nats_adapter.on_reconnect`). Real
    crash and restart of nats-server: the entry, purged meanwhile (a write an unsynced bucket lost), is put again
    once the connection is back. Without the connection's `reconnected_cb` it would never be."""
    from bus.transport.connection import connect

    worker_id, region, bucket = unique("w"), unique("r"), unique("idx")

    async def main() -> Any:
        from nats.js.api import KeyValueConfig

        nc = await connect(crashable_nats.url, "outbox-reconnect", reconnect_forever=True)
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=bucket, history=1))
        machine = a_machine("00000000000002", "m", "reidx2", region, worker_id, "created", 1)
        outbox = Outbox(nc, worker_id=worker_id, index_bucket=bucket, timeout=2.0, machines=lambda: [machine])
        task = asyncio.create_task(outbox.run())
        await until(lambda: asyncio.sleep(0, len(nc.reconnect_hooks) == 1), "the outbox listening for reconnects")
        outbox.index(machine)

        async def stored() -> Any:
            try:
                return await kv.get(machine.id)
            except Exception:
                return None

        await until(stored, "the index entry stored")
        await kv.purge(machine.id)
        assert await stored() is None
        crashable_nats.kill()
        crashable_nats.start()
        found = await until(stored, "the entry put again after the reconnect", timeout=20)
        assert nc.stats["reconnects"] >= 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # the reindexing task's own cancellation
        hooks_left = len(nc.reconnect_hooks)
        await nc.close()
        return found, hooks_left

    entry, hooks_left = arun(main())
    assert msgspec.json.decode(entry.value)["worker_id"] == worker_id
    assert hooks_left == 0  # a stopped outbox listens no more


def test_record_events_are_the_tail_with_the_record_sequence() -> None:
    events = [
        MachineEvent(status="started", seq=4),
        MachineEvent(type="exit", seq=9),
        MachineEvent(status="failed", seq=9),
    ]
    assert [e.type for e in record_events(events, 9)] == ["exit", "transition"]
    assert record_events(events, 4) == []  # superseded: not the tail
    assert record_events([], 1) == []
    assert [n for n, _ in with_n(events)] == [0, 0, 1]  # an exit and its state share record 9
    assert with_n([]) == []
    assert parse_msg_id(event_msg_id("w1", "0123456789abcd", 42, 1)) == (42, 1)
    assert parse_msg_id("nonsense") is None


def test_a_machine_keeps_its_newest_events_in_whole_records() -> None:
    exit_then_state = [MachineEvent(type="exit", seq=9), MachineEvent(status="failed", seq=9)]
    events = [MachineEvent(status="started", seq=4), *exit_then_state, *[MachineEvent(seq=10 + i) for i in range(19)]]
    kept = newest_events(events)  # the 20th newest is record 9's state: without its exit it is not kept
    assert [e.seq for e in kept] == list(range(10, 29)) and len(kept) == 19
    assert newest_events(events[3:]) == events[3:]  # 19 events: nothing to drop
    fits = [*exit_then_state, *[MachineEvent(seq=10 + i) for i in range(18)]]
    assert newest_events(fits) == fits  # 20 exactly
    unsealed = [*events[:-2], MachineEvent(type="exit"), MachineEvent(status="stopped")]  # seq 0: being added
    assert newest_events(unsealed)[-2:] == unsealed[-2:]


def test_what_the_stream_lacks_of_a_machine() -> None:
    now_ms = 1_000_000.0 * 1000
    events = with_n(
        [
            MachineEvent(status="started", seq=4, timestamp=now_ms - 9000),
            MachineEvent(type="exit", seq=9, timestamp=now_ms - 5000),
            MachineEvent(status="failed", seq=9, timestamp=now_ms - 5000),
        ]
    )
    keys = lambda chosen: [(e.seq, n) for n, e in chosen]  # noqa: E731
    assert keys(missing(events, (9, 0), None)) == [(9, 1)]  # after the last one there
    assert keys(missing(events, (4, 0), None)) == [(9, 0), (9, 1)]
    assert keys(missing(events, (9, 1), None)) == []
    assert keys(missing(events, None, 0.0)) == [(9, 0), (9, 1)]  # unknown: the newest record
    assert keys(missing(events, NOTHING, None)) == [(9, 0), (9, 1)]  # nothing there, limits unknown: the same
    assert keys(missing(events, NOTHING, 0.0)) == [(4, 0), (9, 0), (9, 1)]  # nothing there, no age limit: all
    assert keys(missing(events, NOTHING, 1_000_000.0 - 7)) == [(9, 0), (9, 1)]  # younger than the max age


def test_a_machine_the_stream_has_nothing_of_gets_what_the_stream_would_keep(
    nats_url: str, unique: Callable[[str], str]
) -> None:
    """In-process outbox, real nats-server: a machine whose every event was lost with its worker (created
    just before a kill -9) gets them all back; one whose history aged out of the stream does not."""
    worker_id, region = unique("w"), unique("r")
    now = time.time()

    def stored(name: str, ages: list[float]) -> StoredMachine:
        machine = a_machine(f"{name:0>14}", name, "lost", region, worker_id, "started", len(ages))
        events = [
            MachineEvent(status=f"s{seq}", seq=seq, timestamp=(now - age) * 1000, machine_id=machine.id)
            for seq, age in enumerate(ages, start=1)
        ]
        return StoredMachine(machine=machine, events=events)

    async def main() -> dict[str, list[str]]:
        nc = await nats.connect(nats_url)
        await ensure_fleet_resources(nc.jetstream())  # FAUXMAD_EVENTS keeps 7 days
        outbox = Outbox(nc, worker_id=worker_id)
        week = 7 * 24 * 3600
        await outbox.republish([stored("fresh", [30, 20, 10]), stored("aged", [week + 60, week + 30, 10])])
        task = asyncio.create_task(outbox.run())
        while outbox.pending:
            await asyncio.sleep(0.05)
        task.cancel()
        js = nc.jetstream()
        found: dict[str, list[str]] = {}
        for _, event in await stream_events(js, worker_id):
            found.setdefault(event["machine_id"], []).append(event["status"])
        await nc.close()
        return found

    found = arun(main())
    assert found == {f"{'fresh':0>14}": ["s1", "s2", "s3"], f"{'aged':0>14}": ["s3"]}
