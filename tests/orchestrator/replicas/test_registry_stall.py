"""A worker registry whose watch stalls without a reconnect makes it again, and hears the heartbeats once more.

A KV watch's consumer lives on the bucket stream's leader. When that server dies or is cut off, a client connected
to another server keeps its connection and its watch hears nothing more. The nemesis on hosts found an operator in
that state: three live workers stayed lost in its registry and two replaced primaries kept both copies running.
Here the watch's consumer is deleted on a real nats-server (the same silence, with no reconnect) while a worker
keeps beating.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bus.contract.codec import encode
from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Resources
from bus.transport.jetstream import ensure_fleet_resources
from bus.transport.nats_adapter import watch_consumer
from orchestrator.replicas.workers import Registry
from tests.helpers import arun, connect_nats, until


def test_a_stalled_watch_is_made_again_and_the_heartbeats_are_heard(
    nats_url: str, unique: Callable[[str], str]
) -> None:
    region, worker_id = unique("r"), unique("w")

    async def scenario() -> None:
        nc = await connect_nats(nats_url)
        registry = Registry()
        try:
            kv = (await ensure_fleet_resources(nc.jetstream())).workers

            async def beat() -> float:
                stamp = time.time()
                info = WorkerInfo(
                    worker_id=worker_id, region=region, capacity=Resources(1, 64), used=Resources(), heartbeat_at=stamp
                )
                await kv.put(f"{region}.{worker_id}", encode(info))
                return stamp

            await beat()
            await registry.start(kv)
            assert registry.is_live(worker_id)
            stalled = registry._watcher
            where = watch_consumer(stalled)
            assert where is not None
            js, stream, consumer = where
            await js.delete_consumer(stream, consumer)  # the watch now hears nothing, and the connection is fine

            async def heard_again() -> bool:
                stamp = await beat()
                info = registry.get(worker_id)
                return info is not None and info.heartbeat_at >= stamp - 1.0 and registry._watcher is not stalled

            await until(heard_again, "a heartbeat heard through a new watch", 20, interval=0.5)
        finally:
            await registry.close()
            await nc.close()

    arun(scenario())
