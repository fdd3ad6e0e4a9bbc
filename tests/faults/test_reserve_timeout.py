"""A timeout is not a refusal: one idempotency key leads to exactly one machine, however a worker freezes.

A region of three real workers and a real broker. The broker waits for every live worker's offer, so
freezing one worker (SIGSTOP) holds the auction open long enough to freeze the winner too, after it
offered and before its reserve arrives. Before the fix the broker took the reserve's timeout for a
refusal and reserved on the next worker; the frozen one then committed its reserve as well, and one
key had two machines.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import threading
import time
from collections.abc import Iterator

import msgspec
import nats
import pytest

from bus.contract.errors import DeadlineExceeded
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.stores.kv_keys import kv_keys
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, until

SLEEP = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))


@pytest.fixture
def fleet() -> Iterator[DevFleet]:
    # the long offer deadline is what lets the test freeze the winner between its offer and its reserve
    spec = FleetSpec(regions=["a"], workers_per_region=3, cpus=4, memory_mb=4096, brokers=1, deadline_ms=1500)
    with DevFleet(spec) as running:
        yield running


async def crowd(fleet: DevFleet, app: str) -> set[str]:
    """Two machines of `app` on each of `a-w2` and `a-w3`, straight on the workers: the spread penalty then
    makes `a-w1` the winner of the app's next auction. Returns their `worker/id`s."""
    nc = await connect_nats(fleet.url)
    placed = set()
    try:
        for worker_id in ("a-w2", "a-w2", "a-w3", "a-w3"):
            payload = {"app": app, "region": "a", "config": {"cmd": ["true"], "guest": {"cpus": 1, "memory_mb": 64}}}
            msg = await nc.request(
                f"fauxmad.v1.worker.{worker_id}.machines.reserve", msgspec.json.encode(payload), timeout=5
            )
            assert not msg.headers, msg.data
            placed.add(f"{worker_id}/{msgspec.json.decode(msg.data)['id']}")
    finally:
        await nc.close()
    return placed


def pid_of(fleet: DevFleet, name: str) -> int:
    return next(proc.pid for known, proc in fleet.processes if known == name and proc.poll() is None)


async def answers(fleet: DevFleet, worker_id: str) -> bool:
    nc = await connect_nats(fleet.url)
    try:
        await nc.request(f"fauxmad.v1.worker.{worker_id}.info", b"", timeout=0.5)
        return True
    except Exception:
        return False
    finally:
        await nc.close()


def freeze(
    pid: int, after: float, for_: float, thaw: threading.Event | None = None, thawed_at: list[float] | None = None
) -> threading.Thread:
    """SIGSTOP `pid` `after` seconds from now, for `for_` seconds or until `thaw` is set, whichever is first;
    the wall-clock time just before the SIGCONT goes into `thawed_at`."""

    def run() -> None:
        time.sleep(after)  # when the freeze starts relative to the auction (the auction waits 1.5 s)
        os.kill(pid, signal.SIGSTOP)
        (thaw or threading.Event()).wait(for_)
        if thawed_at is not None:
            thawed_at.append(time.time())
        os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def machines_everywhere(fleet: DevFleet, app: str) -> dict[str, list[str]]:
    """Every worker's own answer (the source of truth), the routing index, and the events stream."""
    nc = await connect_nats(fleet.url)
    try:
        on_workers = []
        for worker_id in fleet.worker_ids:
            msg = await nc.request(
                f"fauxmad.v1.worker.{worker_id}.machines.list", msgspec.json.encode({"app": app}), timeout=5
            )
            on_workers += [
                f"{m['worker_id']}/{m['id']}" for m in msgspec.json.decode(msg.data) if m["state"] != "destroyed"
            ]
        kv = await nc.jetstream().key_value("fauxmad_machines")
        indexed = []
        for key in await kv_keys(kv):
            entry = msgspec.json.decode((await kv.get(key)).value)
            if entry["app"] == app:
                indexed.append(f"{entry['worker_id']}/{entry['id']}")
        js = nc.jetstream()
        sub = await js.subscribe(f"fauxmad.v1.events.*.*.{app}.*", ordered_consumer=True)
        created = []
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                break
            event = msgspec.json.decode(msg.data)
            if event["status"] == "created" and event["reason"] == "reserved":
                created.append(f"{event['worker_id']}/{event['machine_id']}")
        await sub.unsubscribe()
        return {"workers": sorted(on_workers), "index": sorted(indexed), "events": sorted(created)}
    finally:
        await nc.close()


async def settle(fleet: DevFleet, app: str, crowd: set[str]) -> dict[str, list[str]]:
    """The three views (less the crowd) once the workers' outboxes have caught up (a frozen one publishes late)."""
    deadline = time.monotonic() + 10
    while True:
        seen = {
            view: [m for m in found if m not in crowd]
            for view, found in (await machines_everywhere(fleet, app)).items()
        }
        if seen["workers"] == seen["index"] == seen["events"] or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.2)


def test_a_frozen_winner_leaves_one_machine_per_key(fleet: DevFleet) -> None:
    async def main() -> None:
        crowded = await crowd(fleet, "frozen")
        client = await FleetClient.connect(fleet.url)
        try:
            winner = pid_of(fleet, "worker-a-w1")
            holdout = pid_of(fleet, "worker-a-w3")
            os.kill(holdout, signal.SIGSTOP)  # the auction now waits its whole deadline for a-w3's offer
            try:
                thawed_at: list[float] = []
                # after a-w1 offered, through its reserve's timeout
                freezing = freeze(winner, after=0.5, for_=4.0, thawed_at=thawed_at)
                started = time.perf_counter()
                machine = await client.create(
                    "frozen",
                    CreateRequest(region="a", config=SLEEP, skip_launch=True, idempotency_key="frozen-1", explain=True),
                )
                took = time.perf_counter() - started
            finally:
                os.kill(holdout, signal.SIGCONT)
            again = await client.create(
                "frozen", CreateRequest(region="a", config=SLEEP, skip_launch=True, idempotency_key="frozen-1")
            )
        finally:
            await client.close()
        assert again.id == machine.id
        attempts = machine.explain["attempts"]  # type: ignore[index]
        assert attempts[0]["worker_id"] == "a-w1", attempts  # the frozen worker did win the auction
        seen = await settle(fleet, "frozen", crowded)
        assert seen["workers"] == [f"{machine.worker_id}/{machine.id}"], (seen, attempts, took)
        assert seen["index"] == seen["workers"] and seen["events"] == seen["workers"], seen
        # the fix itself, not only its effect (the worker's refusal to commit an expired reserve also keeps one
        # machine per key): the broker did not take a-w1's silence for a refusal. It asked a-w1 again once a-w1
        # could answer, learned it reserved nothing, and only then reserved elsewhere: the machine was made
        # after a-w1's thaw (one clock: all on this host)
        await asyncio.to_thread(freezing.join)
        assert "reserved nothing" in attempts[0]["outcome"], attempts
        assert machine.worker_id != "a-w1" and thawed_at, (machine, thawed_at)
        made_at = datetime.datetime.fromisoformat(machine.created_at).timestamp()
        assert made_at > thawed_at[0], (machine.created_at, thawed_at, attempts)

    arun(main())


def test_a_worker_that_stays_silent_is_an_unknown_outcome_and_the_retry_finds_out(fleet: DevFleet) -> None:
    async def main() -> None:
        crowded = await crowd(fleet, "silent")
        client = await FleetClient.connect(fleet.url)
        request = CreateRequest(region="a", config=SLEEP, skip_launch=True, idempotency_key="silent-1")
        try:
            winner = pid_of(fleet, "worker-a-w1")
            holdout = pid_of(fleet, "worker-a-w3")
            os.kill(holdout, signal.SIGSTOP)
            try:
                # frozen through the reserve's timeout and the probe's: the broker cannot know, so it says so;
                # thawed once the broker has said so (30 s: a bound only, should the 504 never come)
                answered = threading.Event()
                thawed = freeze(winner, after=0.5, for_=30.0, thaw=answered)
                try:
                    with pytest.raises(DeadlineExceeded) as raised:
                        await client.create("silent", request)
                finally:
                    answered.set()
            finally:
                os.kill(holdout, signal.SIGCONT)
            assert "outcome is unknown" in raised.value.message
            # a-w1 is back (its freeze over, answering again); the retry asks it before placing anywhere
            await asyncio.to_thread(thawed.join)
            await until(lambda: answers(fleet, "a-w1"), "a-w1 answering again after its freeze")
            machine = await client.create("silent", request)
            again = await client.create("silent", request)
        finally:
            await client.close()
        assert again.id == machine.id
        seen = await settle(fleet, "silent", crowded)
        assert seen["workers"] == [f"{machine.worker_id}/{machine.id}"], seen
        assert seen["index"] == seen["workers"] and seen["events"] == seen["workers"], seen

    arun(main())
