"""`bus.stores.kv_watch.stop_watch` against a real nats-server: a stopped watch leaves no consumer on the stream
(nats-py's own `stop()` leaves it for five minutes, and a stream holds at most 1,000)."""

from __future__ import annotations

from bus.stores.kv_watch import stop_watch
from tests.helpers import arun, connect_nats


def test_a_stopped_watch_leaves_no_consumer(nats_url: str, unique: object) -> None:
    bucket = f"watch_{unique('b')}"  # type: ignore[operator]

    async def main() -> tuple[int, int, int]:
        nc = await connect_nats(nats_url)
        try:
            js = nc.jetstream()
            kv = await js.create_key_value(bucket=bucket, history=1)
            await kv.put("k", b"v")
            watchers = [await kv.watch("k") for _ in range(3)]
            during = (await js.stream_info(f"KV_{bucket}")).state.consumer_count
            await watchers[0].stop()  # nats-py's own stop: its consumer stays
            for watcher in watchers[1:]:
                await stop_watch(watcher)
            after = (await js.stream_info(f"KV_{bucket}")).state.consumer_count
            await js.delete_key_value(bucket)
            return during, after, len(watchers)
        finally:
            await nc.close()

    during, after, made = arun(main())
    assert (during, after) == (made, 1), "stop_watch left its consumer on the server"
