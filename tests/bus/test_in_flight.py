"""A request in flight when its nats-server is killed ends at once as "no answer: it may have arrived"
(`bus.transport.in_flight`), not at its 30 s timeout: nats-py's requests (a fleet API call, its JetStream
calls) and `FastJetStream`'s alike. The connection then reconnects and the next request is answered."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.aio.msg import Msg

from bus.contract.errors import Unanswered, Unreachable
from bus.local.embedded import EmbeddedNats
from bus.transport.connection import connect
from bus.transport.jsfast import FastJetStream
from bus.transport.service import request
from tests.helpers import arun, connect_nats

LONG = 30.0  # the create's timeout: the requests below must end long before it


def test_requests_in_flight_end_when_their_server_is_killed(fresh_nats: EmbeddedNats) -> None:
    server = fresh_nats

    async def main() -> None:
        nc = await connect(server.url, "in-flight", agent=True)
        fast = await FastJetStream(nc, timeout=LONG).start()
        silent = await connect_nats(server.url, allow_reconnect=False)
        heard: set[str] = set()
        both_heard = asyncio.Event()

        async def hear(msg: Msg) -> None:  # receives, never answers: the killed server had the reply to carry
            heard.add(msg.subject)
            if heard == {"slow.api", "slow.fast"}:
                both_heard.set()

        await silent.subscribe("slow.>", cb=hear)
        await silent.flush()
        api = asyncio.ensure_future(request(nc, "slow.api", b"{}", timeout=LONG))
        lean = asyncio.ensure_future(fast.request("slow.fast", b"{}"))
        # Both delivered before the kill, so both are in flight. Killed once the first was heard, the second could
        # still be in its client's buffer: sent after the reconnect, where nobody listened, it got "no responders",
        # which is right (the server says it delivered it to no one: a clean refusal, never a may-have-arrived).
        heard_both = asyncio.ensure_future(both_heard.wait())
        # a request that ends before it is heard (refused, or answered by someone) says how, rather than a bare
        # TimeoutError (CI32's, whose requests' outcomes went unseen); the bound is for a delivery on one host
        await asyncio.wait({heard_both, api, lean}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        ended = {name: task for name, task in (("slow.api", api), ("slow.fast", lean)) if task.done()}
        # CI58c and CI69: both refused at once ("no responders") though the silent subscriber had subscribed and
        # flushed first, on the same live server. nats-py's flush wrote its PING ahead of the SUB still in its
        # pending buffer, so the server answered the PING before it had the subscription; `connect_nats` now gives
        # the fleet's Connection, whose flush writes what is pending first (`nats_adapter.flushed`)
        alive = server.process is not None and server.process.poll() is None
        assert not ended, (
            f"{ {name: repr(task.exception()) for name, task in ended.items()} }; requests on {_server_of(nc)}, "
            f"subscriber on {_server_of(silent)} (connected: {silent.is_connected}); the fixture's server "
            f"{server.url} (alive: {alive})"
        )
        assert heard_both.done(), f"after 30 s the silent subscriber had heard only {sorted(heard)}"
        await asyncio.to_thread(server.kill)
        done, _ = await asyncio.wait({api, lean}, timeout=LONG / 3)
        assert done == {api, lean}, "a request in flight waited for its timeout after its server died"
        with pytest.raises(Unanswered, match="connection to NATS broke on the way"):
            api.result()
        with pytest.raises(Unreachable, match="connection to NATS broke on the way"):
            lean.result()

        await asyncio.to_thread(server.start)
        with contextlib.suppress(Exception):
            await silent.close()
        answered = await connect_nats(server.url)
        try:

            async def echo(msg: object) -> None:
                await msg.respond(b"{}")  # type: ignore[attr-defined]

            await answered.subscribe("echo", cb=echo)
            await answered.flush()
            reply = await request(nc, "echo", b"{}", timeout=10.0)  # sent once reconnected (or buffered until then)
            assert reply.data == b"{}"
        finally:
            await answered.close()
            await nc.close()

    arun(main())


def _server_of(nc: object) -> str:
    """The server id and address a nats-py connection is on (from the server's INFO), for a failure's message."""
    info = getattr(nc, "_server_info", None) or {}
    url = getattr(nc, "connected_url", None)
    return f"{info.get('server_id', '?')[:8]} {info.get('server_name', '?')} {getattr(url, 'netloc', url)}"
