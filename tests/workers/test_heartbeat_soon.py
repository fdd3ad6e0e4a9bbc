"""A change of usage beats soon, coalesced: a machine's change within a quarter of the interval, a volume's
within 50 ms, one beat for every change until it goes (issue 44: at 50 ms a worker beat 0.65 times a reserve).

Real nats-server: the beats are counted as the KV puts they are, on the bucket's subject.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import msgspec

from bus.contract import subjects
from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Resources
from bus.transport.jetstream import ensure_fleet_resources
from tests.helpers import arun, connect_nats, until
from workers.agent.heartbeat import GROUP_MAX, SKEW_EVERY, BeatGroup, Heartbeat

INTERVAL = 2.0  # a machine's change then waits half a second


def test_changes_share_one_beat_and_a_volume_brings_a_machines_beat_forward(
    nats_url: str, unique: Callable[[str], str]
) -> None:
    region, worker_id = unique("r"), unique("w")

    async def scenario() -> None:
        nc = await connect_nats(nats_url)
        tasks: list[asyncio.Task[None]] = []
        heard: list[float] = []
        try:
            kv = await ensure_fleet_resources(nc.jetstream())

            async def on_put(msg: Any) -> None:
                heard.append(time.perf_counter())

            await nc.subscribe(subjects.kv_put(subjects.WORKERS_BUCKET, f"{region}.{worker_id}"), cb=on_put)
            heartbeat = Heartbeat(
                nc,
                kv,
                region=region,
                worker_id=worker_id,
                interval=INTERVAL,
                info=lambda: WorkerInfo(
                    worker_id=worker_id, region=region, capacity=Resources(1, 64), used=Resources()
                ),
                spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
            )

            # ten machines' changes in a burst: one beat
            for _ in range(10):
                heartbeat.usage_changed()
            await asyncio.gather(*tasks)
            await until(lambda: _true(heard), "the burst's beat", 10)
            assert len(heard) == 1, heard

            # a machine's change, then a volume's: the volume's beat goes (within 50 ms) and carries both; the
            # machine's stands down
            tasks.clear()
            heard.clear()
            heartbeat.usage_changed()
            heartbeat.soon()
            assert len(tasks) == 2
            await asyncio.gather(*tasks)  # the machine's own beat stood down
            await until(lambda: _true(heard), "the volume's beat", 10)
            await asyncio.sleep(0.2)  # a second beat, had one gone, would be heard by now on loopback
            assert len(heard) == 1, heard
        finally:
            for task in tasks:
                task.cancel()
            await nc.close()

    arun(scenario())


async def _true(items: list[float]) -> bool:
    return bool(items)


def _members(nc: Any, kv: Any, region: str, count: int, tasks: list[asyncio.Task[None]]) -> BeatGroup:
    """A group of `count` logical workers' heartbeats, as one process's (`BeatGroup`)."""
    group = BeatGroup(INTERVAL, count)
    for n in range(count):
        worker_id = f"w{n}"
        group.add(
            Heartbeat(
                nc,
                kv,
                region=region,
                worker_id=worker_id,
                interval=INTERVAL,
                info=lambda worker_id=worker_id, n=n: WorkerInfo(  # type: ignore[misc]
                    worker_id=worker_id, region=region, capacity=Resources(1, 64), used=Resources(), machines=n
                ),
                spawn=lambda coro: tasks.append(asyncio.ensure_future(coro)),
            )
        )
    return group


def test_a_group_of_logical_workers_puts_one_key_and_measures_its_hosts_clock_once(fresh_nats: Any) -> None:
    """A process's logical workers beat together, one put of their group's key (`subjects.group_key`) carrying
    every member's info, and their changes of usage share one put of it. They share one host clock: the first
    member reads its key's stored beat back every SKEW_EVERY beats to measure the skew, and the others take its
    figures (before: each its own read, 100 JetStream requests a second at 1,000 workers). A server of its own,
    so the reads counted are these workers'."""
    region = "rclock"
    members = 3

    async def scenario() -> tuple[int, list[str], list[tuple[float, float]], dict[str, Any]]:
        nc = await connect_nats(fresh_nats.url)
        reads: list[str] = []
        puts: list[str] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            kv = await ensure_fleet_resources(nc.jetstream())

            async def on_read(msg: Any) -> None:
                reads.append(msg.subject)

            async def on_put(msg: Any) -> None:
                puts.append(msg.subject)

            for api in ("$JS.API.STREAM.MSG.GET.>", "$JS.API.DIRECT.GET.>"):
                await nc.subscribe(api, cb=on_read)
            await nc.subscribe(subjects.kv_put(subjects.WORKERS_BUCKET, f"{region}.>"), cb=on_put)
            group = _members(nc, kv, region, members, tasks)
            # the first member measures at its key's beats 0 and SKEW_EVERY; the others take it
            beats = SKEW_EVERY + 2
            for _ in range(beats):
                await group.keys[0].beat()
            # a change of each member: one more put of the key, within the quarter interval
            for member in group.members:
                member.usage_changed()
            await asyncio.gather(*tasks)
            await until(lambda: _true([1.0] * (len(puts) >= beats + 1)), "the key's puts", 10)
            await nc.flush()
            await asyncio.sleep(0.2)  # a read or a put, had one more gone, is heard by now on loopback
            measured = len(reads)  # before this test's own read of the key
            stored = msgspec.json.decode((await kv.workers.get(subjects.group_key(region, "w0"))).value)
            return measured, puts, [(m.skew, m.skew_error) for m in group.members], stored
        finally:
            for task in tasks:
                task.cancel()
            await nc.close()

    reads, puts, skews, stored = arun(scenario())
    assert puts == [subjects.kv_put(subjects.WORKERS_BUCKET, subjects.group_key(region, "w0"))] * (SKEW_EVERY + 3)
    assert sorted(stored["beats"]) == ["w0", "w1", "w2"]
    assert [stored["beats"][f"w{n}"]["machines"] for n in range(members)] == [0, 1, 2]
    assert reads == 2, f"{reads} reads of stored beats for one host's clock"
    assert skews[0][1] > 0 and all(skew == skews[0] for skew in skews)  # measured once, taken by all


def test_a_group_puts_a_key_for_each_group_max_members_one_a_tick() -> None:
    """At most `GROUP_MAX` members a key (its value stays about 100 KB, far below a server's `max_payload`), each
    member in one key, and one key a tick: the ticks of an interval beat every member once."""
    for size in (2, GROUP_MAX, GROUP_MAX + 1, 300):
        group = BeatGroup(INTERVAL, size)
        for n in range(size):
            group.add(cast(Heartbeat, SimpleNamespace(worker_id=f"w{n}", region="r")))
        assert group.ticks == len(group.keys) == -(-size // GROUP_MAX), size
        assert all(len(key.members) <= GROUP_MAX for key in group.keys)
        keyed = [member for key in group.keys for member in key.members]
        assert [id(m) for m in keyed] == [id(m) for m in group.members]
        assert all(member.group is key for key in group.keys for member in key.members)
        assert [key.key for key in group.keys] == [f"r.w{n * GROUP_MAX}.group" for n in range(len(group.keys))]
