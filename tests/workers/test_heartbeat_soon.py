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

from bus.contract import subjects
from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Resources
from bus.transport.jetstream import ensure_fleet_resources
from tests.helpers import arun, connect_nats, until
from workers.agent.heartbeat import PER_TICK, SKEW_EVERY, BeatGroup, Heartbeat

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


def test_a_group_of_logical_workers_measures_its_hosts_clock_once(fresh_nats: Any) -> None:
    """A process's logical workers share one host clock: the group's first member reads its stored beat back
    every SKEW_EVERY beats to measure the skew, and the others take its figures (before: each its own read,
    100 JetStream requests a second at 1,000 workers). Each still puts its own key. A server of its own, so the
    reads counted are these workers'."""
    region = "rclock"
    members = 3

    async def scenario() -> tuple[int, int, list[tuple[float, float]]]:
        nc = await connect_nats(fresh_nats.url)
        reads: list[str] = []
        puts: list[str] = []
        try:
            kv = await ensure_fleet_resources(nc.jetstream())

            async def on_read(msg: Any) -> None:
                reads.append(msg.subject)

            async def on_put(msg: Any) -> None:
                puts.append(msg.subject)

            for api in ("$JS.API.STREAM.MSG.GET.>", "$JS.API.DIRECT.GET.>"):
                await nc.subscribe(api, cb=on_read)
            await nc.subscribe(subjects.kv_put(subjects.WORKERS_BUCKET, f"{region}.>"), cb=on_put)
            group = BeatGroup(INTERVAL)
            for n in range(members):
                worker_id = f"w{n}"
                group.add(
                    Heartbeat(
                        nc,
                        kv,
                        region=region,
                        worker_id=worker_id,
                        interval=INTERVAL,
                        info=lambda worker_id=worker_id: WorkerInfo(  # type: ignore[misc]
                            worker_id=worker_id, region=region, capacity=Resources(1, 64), used=Resources()
                        ),
                        spawn=lambda coro: None,
                    )
                )
            # the first member measures at its beats 0 and SKEW_EVERY; the others take it at their next beat
            beats = SKEW_EVERY + 2
            for _ in range(beats):
                await asyncio.gather(*(member.once() for member in group.members))
            await until(lambda: _true([1.0] * (len(puts) >= beats * members)), "every member's puts", 10)
            await nc.flush()
            await asyncio.sleep(0.2)  # a read, had one gone, is heard by now on loopback
            return len(reads), len(puts), [(m.skew, m.skew_error) for m in group.members]
        finally:
            await nc.close()

    reads, puts, skews = arun(scenario())
    assert puts == (SKEW_EVERY + 2) * members  # every member still beats its own key
    assert reads == 2, f"{reads} reads of stored beats for one host's clock"
    assert skews[0][1] > 0 and all(skew == skews[0] for skew in skews)  # measured once, taken by all


def test_a_group_beats_each_member_once_an_interval_a_few_at_each_tick() -> None:
    """Not all at once (a burst every interval that a create meeting it waited behind): `PER_TICK` members a
    tick, every member at one tick of each interval, whatever the order they joined in."""
    for size in (2, 4, 5, 125):
        group = BeatGroup(INTERVAL, size)
        for n in range(size):
            group.add(cast(Heartbeat, SimpleNamespace(name=n, clock_of=None)))
        for first in (0, 7):  # any run of `ticks` ticks
            window = [group.due(tick) for tick in range(first, first + group.ticks)]
            beaten = [member for members in window for member in members]
            assert sorted(id(m) for m in beaten) == sorted(id(m) for m in group.members), size
            assert max(len(members) for members in window) <= PER_TICK
        assert group.ticks == -(-size // PER_TICK)
