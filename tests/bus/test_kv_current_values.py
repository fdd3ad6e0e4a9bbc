"""`bus.stores.kv_watch.current_values`: what a bucket holds now, read through one watch that ends at the value
with nothing left to send, not at nats-py's end-of-values marker (which a loaded host may queue before the values:
CI35's empty `job list`). Real nats-server; the race itself needs a loaded host, so 200 reads of a bucket made
fresh for each run the same code path a worker's desk runs, each checked whole."""

from __future__ import annotations

import asyncio

from nats.js.api import KeyValueConfig

from bus.stores.kv_watch import current_values
from tests.helpers import arun, connect_nats


def test_current_values_are_every_live_key_of_the_pattern_and_none_deleted(nats_url: str) -> None:
    async def main() -> None:
        nc = await connect_nats(nats_url)
        try:
            kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="current_values_test", history=1))
            assert await current_values(kv, "a.*", timeout=10) == []  # nothing at all: the marker ends it
            for n in range(5):
                await kv.put(f"a.k{n}", str(n).encode())
            await kv.put("b.k0", b"other app")
            await kv.delete("a.k4")  # the last message the watch sends is a delete
            got = await current_values(kv, "a.*", timeout=10)
            assert sorted((e.key, e.value) for e in got) == [(f"a.k{n}", str(n).encode()) for n in range(4)]
            await kv.delete("a.k0")
            await kv.put("a.k1", b"new")
            got = await current_values(kv, "a.*", timeout=10)
            assert sorted((e.key, e.value) for e in got) == [("a.k1", b"new"), ("a.k2", b"2"), ("a.k3", b"3")]
            reads = await asyncio.gather(*(current_values(kv, "a.*", timeout=30) for _ in range(200)))
            assert all(sorted(e.key for e in read) == ["a.k1", "a.k2", "a.k3"] for read in reads)
            await nc.jetstream().delete_key_value("current_values_test")
        finally:
            await nc.close()

    arun(main())
