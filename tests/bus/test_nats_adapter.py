"""What `bus.transport.nats_adapter` reads of nats-py's private state is where it reads it, against a real
nats-server: a nats-py upgrade that moves one fails here, by name, instead of silently turning a guard off (a
request that waits out its timeout after its server died, a watch's consumer left behind on the server, the
layout of a connection looked up under the wrong key). And our `Connection`'s own fields shadow nothing of
nats-py's client."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from bus.transport.connection import connect
from bus.transport.nats_adapter import (
    Connection,
    connection_of,
    kv_stream,
    pending_replies,
    refusals_of,
    role_of,
    server_info,
    signer_of,
    watch_consumer,
)
from tests.helpers import arun


def test_our_fields_shadow_nothing_of_nats_py() -> None:
    ours = set(vars(Connection())) - set(vars(Client()))
    assert ours == {"refusals", "signer", "role", "disconnect_hooks", "reconnect_hooks", "noticing"}
    plain = Client()
    assert (signer_of(plain), refusals_of(plain), role_of(plain)) == (None, None, None)


def test_the_private_attributes_read_are_where_they_are_read(nats_url: str, unique: object) -> None:
    bucket = f"adapter_{unique('b')}"  # type: ignore[operator]

    async def main() -> None:
        nc = await connect(nats_url, "adapter-test")
        try:
            assert isinstance(nc, Connection) and role_of(nc) is None  # an open fleet's: no identity
            assert server_info(nc).get("server_id"), "nats-py's _server_info moved"

            silent = f"adapter.{bucket}"

            async def hear(msg: object) -> None:  # hears, never answers
                return None

            await nc.subscribe(silent, cb=hear)
            asking = asyncio.ensure_future(nc.request(silent, b"", timeout=10))
            for _ in range(100):
                if pending_replies(nc):
                    break
                await asyncio.sleep(0.01)
            assert len(pending_replies(nc)) == 1, "nats-py's _resp_map moved: in-flight requests are not failed"
            asking.cancel()

            js = nc.jetstream()
            assert connection_of(js) is nc, "nats-py's JetStreamContext._nc moved"

            kv = await js.create_key_value(bucket=bucket)
            where = kv_stream(kv)
            assert where is not None and (where.stream, where.prefix) == (f"KV_{bucket}", f"$KV.{bucket}.")
            assert connection_of(where.js) is nc, "nats-py's KeyValue._js moved"

            watcher = await kv.watchall()
            consumer = watch_consumer(watcher)
            assert consumer is not None, "nats-py's KeyWatcher._sub (or its _js, _stream, _consumer) moved"
            cjs, stream, name = consumer
            assert stream == f"KV_{bucket}"
            assert (await cjs.consumer_info(stream, name)).name == name  # the consumer the server holds
            await watcher.stop()
            await js.delete_key_value(bucket)
        finally:
            await nc.close()

    arun(main())
