"""The fence: a worker that comes back never runs a keyed machine the fleet placed elsewhere, and a worker
killed mid-start never runs a machine twice (docs/explanation/faults.md).

Found by a seeded random fault run (`fauxmad torture`), reproduced here at the exact step with the fault
points workers honour in tests (tests/faults/points.py, at the steps workers/lifecycle/steps.py names):

- one machine id on two hosts: a worker frozen right after it committed a keyed reserve; the broker gave
  the create a 504, and the retry (the worker's heartbeat expired by then) placed the same id on another
  worker; the frozen one thawed and started its copy too;
- one key, two machines: the same, but the retry found no room and its 503 released the key's claim, so a
  later retry placed a second machine while the first sat on the frozen worker;
- the same through a restart: a worker killed -9 right after the commit, started again after the retry;
- a machine launched twice on one host: a worker killed -9 right after it spawned a machine's process,
  before it recorded it; on its restart it started the machine again beside the first process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from bus.contract.codec import decoder
from bus.contract.errors import DeadlineExceeded, NoCapacity
from bus.contract.fleet import CreateRequest
from bus.contract.idempotency import Claim, claim_key
from bus.contract.ids import new_machine_id
from bus.contract.machines import Guest, Machine, MachineConfig
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.faults import points
from tests.helpers import WorkerProcess, arun, connect_nats, fleet_fixture, until

REGION = "fz"
OTHER = f"{REGION}-w1"  # the fleet's own worker: cordoned while the one under test must win the auction
SLEEP = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))


fleet = fleet_fixture(FleetSpec(regions=[REGION], workers_per_region=1, cpus=4, memory_mb=4096, brokers=1))


@pytest.fixture
def faulty(fleet: DevFleet, tmp_path: Path, unique: Callable[[str], str]) -> Iterator[Callable[[str], WorkerProcess]]:
    """A worker of the region armed with one fault point (it fires once)."""
    started: list[WorkerProcess] = []

    def make(point: str) -> WorkerProcess:
        worker_id = unique("faulty")
        worker = WorkerProcess(
            fleet.url,
            REGION,
            worker_id,
            tmp_path / worker_id,
            cpus=1,
            memory_mb=256,
            env=points.environment(point),
        )
        started.append(worker)
        return worker.start()

    yield make
    for worker in started:
        if worker.proc is not None and worker.proc.poll() is None:
            os.kill(worker.proc.pid, signal.SIGCONT)
        worker.cleanup()


async def cordon(nc: Any, worker_id: str, on: bool) -> None:
    verb = "cordon" if on else "uncordon"
    msg = await nc.request(f"fauxmad.v1.worker.{worker_id}.{verb}", b"{}", timeout=5)
    assert not msg.headers, msg.data


async def heartbeat_gone(nc: Any, worker_id: str) -> bool:
    kv = await nc.jetstream().key_value("fauxmad_workers")
    try:
        await kv.get(f"{REGION}.{worker_id}")
    except nats.js.errors.KeyNotFoundError:
        return True
    return False


async def on_worker(nc: Any, worker_id: str, app: str) -> list[Machine]:
    payload = msgspec.json.encode({"app": app, "include_destroyed": True})
    msg = await nc.request(f"fauxmad.v1.worker.{worker_id}.machines.list", payload, timeout=5)
    return msgspec.json.decode(msg.data, type=list[Machine])


async def once_back_on(nc: Any, worker_id: str, app: str) -> list[Machine] | None:
    """`on_worker` for a worker just thawed: None while it reconnects (frozen past a few seconds, its server
    dropped its connection: `bus.local.server_options`)."""
    try:
        return await on_worker(nc, worker_id, app)
    except nats.errors.NoRespondersError:
        return None


async def events_of(nc: Any, worker_id: str, machine_id: str) -> list[str]:
    payload = msgspec.json.encode({"id": machine_id, "events": True})
    msg = await nc.request(f"fauxmad.v1.worker.{worker_id}.machines.get", payload, timeout=5)
    events = msgspec.json.decode(msg.data, type=Machine).events
    return [event.status for event in events or []]


async def claim_of(nc: Any, app: str, key: str) -> Claim:
    kv = await nc.jetstream().key_value("fauxmad_idempotency")
    return decoder(Claim).decode((await kv.get(claim_key(app, key))).value)


@contextlib.asynccontextmanager
async def connected(fleet: DevFleet) -> AsyncIterator[tuple[Any, FleetClient]]:
    """A raw connection and a client; the fleet's own worker uncordoned again at the end, whatever happened."""
    nc = await connect_nats(fleet.url)
    client = await FleetClient.connect(fleet.url)
    try:
        yield nc, client
    finally:
        await cordon(nc, OTHER, False)
        await client.close()
        await nc.close()


def processes_of(machine_id: str) -> list[int]:
    needle = f"FAUXMAD_MACHINE_ID={machine_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


async def lose_a_keyed_create(
    fleet: DevFleet, nc: Any, client: FleetClient, worker: WorkerProcess, app: str, request: CreateRequest
) -> str:
    """The create goes to `worker`, which stops (its fault point) right after committing the reserve: a 504.
    Returns the machine id it holds, once its heartbeat has expired (brokers no longer wait for it)."""
    await cordon(nc, OTHER, True)
    with pytest.raises(DeadlineExceeded) as raised:
        await client.create(app, request)
    assert "outcome is unknown" in raised.value.message, raised.value.message
    await until(lambda: heartbeat_gone(nc, worker.worker_id), f"{worker.worker_id}'s heartbeat expiring", timeout=15)
    assert request.idempotency_key is not None
    held = (await claim_of(nc, app, request.idempotency_key)).machine_id
    assert held is not None
    return held


def test_a_frozen_worker_back_never_runs_the_id_the_retry_placed_elsewhere(
    fleet: DevFleet, faulty: Callable[[str], WorkerProcess], unique: Callable[[str], str]
) -> None:
    worker = faulty("reserve.committed=freeze")

    async def main() -> None:
        app, key = unique("fence"), "k1"
        request = CreateRequest(region=REGION, config=SLEEP, idempotency_key=key)
        async with connected(fleet) as (nc, client):
            first = await lose_a_keyed_create(fleet, nc, client, worker, app, request)
            await cordon(nc, OTHER, False)
            placed = await client.create(app, request)  # the retry: the frozen worker is fenced, not waited for
            assert placed.worker_id == OTHER and placed.id != first  # a new id: one id is never on two hosts
            claim = await claim_of(nc, app, key)
            assert claim.fenced == [worker.worker_id] and claim.machine_id == placed.id, claim
            assert worker.proc is not None
            os.kill(worker.proc.pid, signal.SIGCONT)  # back: the reserve's launch goes on, and asks the claim

            async def destroyed() -> bool:
                listed = await once_back_on(nc, worker.worker_id, app)
                return listed is not None and any(m.id == first and m.state == "destroyed" for m in listed)

            await until(destroyed, f"{worker.worker_id} destroying its fenced copy {first}", timeout=15)
            statuses = await events_of(nc, worker.worker_id, first)
            assert "started" not in statuses, statuses  # it never ran
            assert processes_of(first) == []

            async def placed_runs() -> list[int]:  # `started` is recorded at the spawn: the exec may come just after
                return processes_of(placed.id)

            await until(placed_runs, f"the process of {placed.id}, placed on {OTHER}")
            again = await client.create(app, request)
            assert (again.id, again.worker_id) == (placed.id, OTHER)

    arun(main())


def test_a_refused_retry_keeps_the_fence_so_one_key_never_gets_two_machines(
    fleet: DevFleet, faulty: Callable[[str], WorkerProcess], unique: Callable[[str], str]
) -> None:
    worker = faulty("reserve.committed=freeze")

    async def main() -> None:
        app, key = unique("fence"), "k2"
        request = CreateRequest(region=REGION, config=SLEEP, idempotency_key=key)
        async with connected(fleet) as (nc, client):
            first = await lose_a_keyed_create(fleet, nc, client, worker, app, request)
            with pytest.raises(NoCapacity):  # the other worker is still cordoned: nowhere to place
                await client.create(app, request)
            claim = await claim_of(nc, app, key)  # kept, with its fence: the frozen copy is not the key's
            assert claim.fenced == [worker.worker_id] and claim.machine_id != first, claim
            assert worker.proc is not None
            os.kill(worker.proc.pid, signal.SIGCONT)

            async def back_and_clean() -> bool:
                listed = await once_back_on(nc, worker.worker_id, app)
                if listed is None:
                    return False
                return not await heartbeat_gone(nc, worker.worker_id) and all(m.state == "destroyed" for m in listed)

            await until(back_and_clean, f"{worker.worker_id} back, its fenced copy destroyed", timeout=15)
            placed = await client.create(app, request)  # the only room is on the worker that came back
            now = await claim_of(nc, app, key)
            assert placed.worker_id == worker.worker_id and placed.id == now.machine_id, (placed, claim, now)
            alive = [
                m.id
                for worker_id in (worker.worker_id, OTHER)
                for m in await on_worker(nc, worker_id, app)
                if m.state != "destroyed"
            ]
            assert alive == [placed.id], alive
            assert "started" not in await events_of(nc, worker.worker_id, first)

    arun(main())


def test_a_killed_worker_restarted_after_the_retry_destroys_its_copy_before_anything_runs(
    fleet: DevFleet, faulty: Callable[[str], WorkerProcess], unique: Callable[[str], str]
) -> None:
    worker = faulty("reserve.committed=kill")

    async def main() -> None:
        app, key = unique("fence"), "k3"
        request = CreateRequest(region=REGION, config=SLEEP, idempotency_key=key)
        async with connected(fleet) as (nc, client):
            first = await lose_a_keyed_create(fleet, nc, client, worker, app, request)
            await cordon(nc, OTHER, False)
            placed = await client.create(app, request)
            assert placed.worker_id == OTHER and placed.id != first
            worker.env = {}
            await asyncio.to_thread(worker.start)  # the same data dir: its log holds `first`, `starting`
            listed = {m.id: m.state for m in await on_worker(nc, worker.worker_id, app)}
            assert listed == {first: "destroyed"}, listed
            assert "started" not in await events_of(nc, worker.worker_id, first)
            assert processes_of(first) == []

    arun(main())


def test_a_worker_killed_between_spawn_and_record_runs_the_machine_once_after_restart(
    fleet: DevFleet, faulty: Callable[[str], WorkerProcess], unique: Callable[[str], str]
) -> None:
    worker = faulty("launch.spawned=kill")

    async def main() -> None:
        app = unique("twice")
        machine_id = new_machine_id()
        reserve = {"app": app, "region": REGION, "config": msgspec.to_builtins(SLEEP), "id": machine_id, "launch": True}
        nc = await connect_nats(fleet.url)
        try:
            with pytest.raises(nats.errors.TimeoutError):  # it dies before it answers
                await nc.request(
                    f"fauxmad.v1.worker.{worker.worker_id}.machines.reserve", msgspec.json.encode(reserve), timeout=3
                )
            assert worker.proc is not None
            await asyncio.to_thread(worker.proc.wait, 10)
            await until(lambda: asyncio.sleep(0, bool(processes_of(machine_id))), "the first run's process")
            stray = processes_of(machine_id)
            worker.env = {}
            await asyncio.to_thread(worker.start)
            listed = {m.id: m.state for m in await on_worker(nc, worker.worker_id, app)}
            assert listed == {machine_id: "started"}, listed
            await until(lambda: asyncio.sleep(0, bool(processes_of(machine_id))), "the machine's process after restart")
            for _ in range(20):  # and only ever one (the stray is gone, and no second start follows)
                running = processes_of(machine_id)
                assert len(running) == 1 and not set(running) & set(stray), (stray, running)
                await asyncio.sleep(0.05)
        finally:
            await nc.close()

    arun(main())
