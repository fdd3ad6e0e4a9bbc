"""Which of the fleet's buckets a lone nats-server acks before their writes are on disk, and which it fsyncs.

Only buckets whose writers write every entry again by themselves are made with `persist_mode` async: the routing
index (each worker puts its machines' entries again after a reconnect) and the heartbeats (each worker puts its
key again every interval, and a key lives a TTL). The idempotency claims and the apps' releases are written once
and must survive a killed server, so they keep nats-server's default (docs/explanation/architecture.md).
"""

from __future__ import annotations

import time

from bus.contract import subjects
from bus.contract.codec import decoder, encode
from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Resources
from bus.local.embedded import EmbeddedNats
from bus.transport.jetstream import FleetConfig, ensure_fleet_resources
from tests.helpers import arun, connect_nats, until


def test_on_a_lone_server_the_heartbeats_and_the_index_are_unsynced_and_the_claims_are_not(
    fresh_nats: EmbeddedNats,
) -> None:
    async def scenario() -> None:
        nc = await connect_nats(fresh_nats.url)
        try:
            js = nc.jetstream()
            kv = await ensure_fleet_resources(js, FleetConfig(heartbeat_interval=0.5))
            modes = {
                bucket: (await js.stream_info(f"KV_{bucket}")).config.persist_mode
                for bucket in (
                    subjects.WORKERS_BUCKET,
                    subjects.MACHINES_BUCKET,
                    subjects.IDEMPOTENCY_BUCKET,
                    subjects.APPS_BUCKET,
                )
            }
            assert modes[subjects.WORKERS_BUCKET] == "async", modes
            assert modes[subjects.MACHINES_BUCKET] == "async", modes
            assert modes[subjects.IDEMPOTENCY_BUCKET] in (None, "default"), modes
            assert modes[subjects.APPS_BUCKET] in (None, "default"), modes

            # the unsynced heartbeats bucket still keeps a beat, and still expires it (the TTL, 3 beats)
            info = WorkerInfo(
                worker_id="w1", region="r1", capacity=Resources(1, 64), used=Resources(), heartbeat_at=time.time()
            )
            await kv.workers.put("r1.w1", encode(info))
            stored = decoder(WorkerInfo).decode((await kv.workers.get("r1.w1")).value)
            assert stored.worker_id == "w1"

            async def expired() -> bool:
                try:
                    entry = await kv.workers.get("r1.w1")
                except Exception:
                    return True
                return entry.value is None or entry.value == b""

            await until(expired, "the beat expired by the bucket's TTL", 10, interval=0.2)
        finally:
            await nc.close()

    arun(scenario())
