"""What `bus.transport.nats_adapter` reads of nats-py's private state is where it reads it, against a real
nats-server: a nats-py upgrade that moves one fails here, by name, instead of silently turning a guard off (a
request that waits out its timeout after its server died, a watch's consumer left behind on the server, the
layout of a connection looked up under the wrong key). And our `Connection`'s own fields shadow nothing of
nats-py's client; and a flush puts on the wire, before its PING, every command made before it."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from bus.transport.connection import connect
from bus.transport.nats_adapter import (
    Connection,
    connection_of,
    flushed,
    kv_stream,
    pending_replies,
    refusals_of,
    role_of,
    server_info,
    signer_of,
    watch_consumer,
)
from tests.helpers import arun

SUB, PING = b"SUB flush.order", b"PING\r\n"


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


async def _recording_relay(target_port: int, written: bytearray) -> asyncio.Server:
    """A TCP relay in front of the nats-server that keeps every byte the client writes, in order."""

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bool) -> None:
            while data := await reader.read(65536):
                if keep:
                    written.extend(data)
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(
            pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False), return_exceptions=True
        )

    return await asyncio.start_server(relay, "127.0.0.1", 0)


def test_a_flush_writes_the_commands_made_before_it_ahead_of_its_ping(nats_url: str) -> None:
    """nats-py's flush writes its PING straight to the socket while a SUB made just before waits in its pending
    buffer for the flusher task: on the wire the PING came first, so the server could answer it before it had the
    subscription (CI69: a request from another connection was refused "no responders"). `flushed`, and so a
    fleet `Connection`'s flush, writes the SUB first. A relay in front of a real nats-server records the order."""
    port = int(nats_url.rsplit(":", 1)[1])

    async def order(flush: str) -> bytes:
        written = bytearray()
        relay = await _recording_relay(port, written)
        client = Connection() if flush == "ours" else Client()
        await client.connect(f"nats://127.0.0.1:{relay.sockets[0].getsockname()[1]}", reconnect_time_wait=0.1)
        try:
            start = len(written)

            async def hear(msg: object) -> None:
                return None

            await client.subscribe("flush.order", cb=hear)
            await (flushed(client) if flush == "flushed" else client.flush())
            return bytes(written[start:])
        finally:
            await client.close()
            relay.close()

    def sub_before_ping(wire: bytes) -> bool:
        return SUB in wire and PING in wire and wire.index(SUB) < wire.index(PING)

    assert not sub_before_ping(arun(order("nats-py"))), "nats-py's own flush now writes in order: `flushed` can go"
    assert sub_before_ping(arun(order("flushed")))
    assert sub_before_ping(arun(order("ours")))
