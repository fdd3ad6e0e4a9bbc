"""kill -9 of nats-server under create load: nothing acknowledged is lost, no key gets two machines.

Clients create machines with idempotency keys and retry every failure with the same key (as a real
client must, since a timeout says nothing about what happened). Midway the server is SIGKILLed and
started again on the same port and store. Afterwards every acknowledged machine is on its worker,
each key has exactly one machine across the workers, the routing index agrees, and the fleet was
serving again soon after the server came back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import msgspec
import nats
import pytest

from bus.contract import subjects
from bus.contract.errors import FauxmadError
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.stores.kv_keys import kv_keys
from bus.transport.connection import connect
from bus.transport.service import call
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats

CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=16))
KEYS = 300
CONCURRENCY = 16


@pytest.fixture
def fleet() -> Iterator[DevFleet]:
    spec = FleetSpec(regions=["k1", "k2"], workers_per_region=2, cpus=200, memory_mb=200 * 1024, brokers=1)
    with DevFleet(spec) as running:
        yield running


async def everything_on_the_workers(fleet: DevFleet, app: str) -> list[dict[str, str]]:
    nc = await connect_nats(fleet.url)
    try:
        found = []
        for worker_id in fleet.worker_ids:
            msg = await nc.request(
                f"fauxmad.v1.worker.{worker_id}.machines.list", msgspec.json.encode({"app": app}), timeout=10
            )
            found += [m for m in msgspec.json.decode(msg.data) if m["state"] != "destroyed"]
        return found
    finally:
        await nc.close()


async def index_of(fleet: DevFleet, app: str) -> dict[str, str]:
    nc = await connect_nats(fleet.url)
    try:
        kv = await nc.jetstream().key_value("fauxmad_machines")
        out: dict[str, str] = {}
        for key in await kv_keys(kv):
            entry = msgspec.json.decode((await kv.get(key)).value)
            if entry["app"] == app:
                out[entry["id"]] = entry["worker_id"]
        return out
    finally:
        await nc.close()


async def create_until_acknowledged(nc: nats.NATS, i: int, failures: Counter[str]) -> Machine:
    """One key, retried with the same key until a machine comes back (a timeout says nothing)."""
    key = f"key-{i:04d}"
    request = CreateRequest(region=("k1", "k2")[i % 2], config=CONFIG, name=key, skip_launch=True, idempotency_key=key)
    deadline = time.perf_counter() + 90
    while True:
        try:
            return await call(nc, subjects.api_machines("crash", "create"), request, Machine, timeout=6)
        except (FauxmadError, nats.errors.Error) as exc:
            failures[type(exc).__name__] += 1
            if time.perf_counter() > deadline:
                raise
            await asyncio.sleep(0.1)


def test_a_nats_crash_under_create_load_loses_nothing_and_duplicates_nothing(fleet: DevFleet) -> None:
    acked: dict[str, Machine] = {}
    failures: Counter[str] = Counter()
    timeline: dict[str, float] = {}

    async def load() -> None:
        nc = await connect(fleet.url, "load", agent=True)  # reconnects, as a long-lived service would
        keys = list(range(KEYS))

        async def client() -> None:
            while keys:
                i = keys.pop(0)
                acked[f"key-{i:04d}"] = await create_until_acknowledged(nc, i, failures)
                if "restarted" in timeline and "first_ack" not in timeline:
                    timeline["first_ack"] = time.perf_counter()

        async def chaos() -> None:
            for share in (3, 2):  # two crashes: at a third and at half of the keys
                while len(acked) < KEYS // share:
                    await asyncio.sleep(0.01)
                fleet.nats.kill()  # type: ignore[union-attr]
                await asyncio.sleep(1.0)
                timeline.pop("first_ack", None)
                # started from this thread: the server's parent-death signal follows the thread that spawned it
                fleet.nats.start()  # type: ignore[union-attr]
                timeline["restarted"] = time.perf_counter()
                while "first_ack" not in timeline:
                    await asyncio.sleep(0.01)
                timeline.setdefault("reconnects", 0.0)
                timeline["reconnects"] = max(timeline["reconnects"], timeline["first_ack"] - timeline["restarted"])

        await asyncio.gather(chaos(), *[client() for _ in range(CONCURRENCY)])
        await nc.close()

    arun(load())
    assert len(acked) == KEYS
    found = arun(everything_on_the_workers(fleet, "crash"))
    by_name = Counter(m["name"] for m in found)
    duplicates = {name: n for name, n in by_name.items() if n > 1}
    lost = [
        key for key, m in acked.items() if not any(f["id"] == m.id and f["worker_id"] == m.worker_id for f in found)
    ]
    reconnect = timeline["reconnects"]
    print(
        f"\n{KEYS} keys, {sum(failures.values())} retried failures {dict(failures)}; "
        f"acknowledged lost {len(lost)}, duplicates {len(duplicates)}; "
        f"first create acknowledged at most {reconnect:.2f}s after a restart"
    )
    print(
        *(
            f"duplicate: {m['name']} {m['worker_id']}/{m['id']} at {m['created_at']}, acknowledged "
            f"{acked[m['name']].worker_id}/{acked[m['name']].id}"
            for m in found
            if m["name"] in duplicates
        ),
        sep="\n",
    )
    assert not lost, lost[:5]
    assert not duplicates, [
        (m["name"], m["worker_id"], m["id"], m["created_at"], acked[m["name"]].id)
        for m in found
        if m["name"] in duplicates
    ]
    assert set(by_name) == set(acked)
    # the routing index converges on the workers' truth (outboxes retry through the outage)
    deadline = time.perf_counter() + 15
    while True:
        index = arun(index_of(fleet, "crash"))
        if index == {m["id"]: m["worker_id"] for m in found} or time.perf_counter() > deadline:
            break
        time.sleep(0.5)
    assert index == {m["id"]: m["worker_id"] for m in found}, (len(index), len(found))
    # the figure (typically 0.2-0.4 s, up to ~2 s on a loaded machine) goes in the notes; this bound only
    # catches a fleet that does not come back on its own
    assert reconnect <= 10.0, f"serving again {reconnect:.2f}s after the restart"


def test_the_brokers_see_every_worker_again_as_soon_as_nats_is_back(fleet: DevFleet) -> None:
    """The brokers' worker registry is a KV watch: after a restart it is made again at once. Before, the watch's
    consumer noticed the lost server only after two missed idle heartbeats, so `workers.list` answered [] for
    12-16 s while every heartbeat was back in KV, and the operator replaced machines of live workers."""

    async def listed(nc: nats.NATS) -> set[str]:
        try:
            msg = await nc.request(subjects.API_WORKERS_LIST, b"{}", timeout=1)
        except Exception:
            return set()
        if msg.headers:
            return set()
        return {w["worker_id"] for w in msgspec.json.decode(msg.data)}

    async def main() -> None:
        nc = await connect(fleet.url, "test-workers-list", agent=True)
        try:
            every = set(fleet.worker_ids)
            assert await listed(nc) == every
            fleet.nats.kill()  # type: ignore[union-attr]
            # the outage itself: the server down for a second
            await asyncio.sleep(1.0)
            fleet.nats.start()  # type: ignore[union-attr]
            restarted = time.perf_counter()
            # from 4 s on (past the registry's 3 s TTL, so remembered heartbeats no longer count) through 10 s,
            # every listing names every worker; the watch's own recovery took 10-15 s
            missed = []
            while (since := time.perf_counter() - restarted) < 10.0:
                seen = await listed(nc)
                if since >= 4.0 and seen != every:
                    missed.append((round(since, 1), sorted(seen)))
                await asyncio.sleep(0.2)
            assert not missed, missed[:5]
        finally:
            await nc.close()

    arun(main())
