"""TCP relays in front of nats-servers' gateway ports, so a loopback supercluster can be partitioned.

A partition of a region is its gateway connections going down, in both directions, while its routes and
its clients stay up. nats-server does not drop gateways on a config reload and blocking a port needs root,
so each server's gateway is reached through a relay here instead (`bus.local.supercluster` points every gateway
URL, and the address each server advertises, at it). The relay knows which region it fronts; it learns
which region dialled in from the first line the dialling server sends, its `CONNECT {..., "gateway":
"<region>"}`. `cut(region)` closes every connection into or out of `region` and refuses new ones until
`heal(region)`; nats-server's gateways then reconnect on their own.

WAN between regions: `delay` holds every byte `delay` seconds in each direction before passing it on (a
propagation delay, one way; no bandwidth limit, no loss, no reordering), what a link between two data centres
adds to a gateway, since this kernel has no netem. `set_delay` changes it while running (a latency spike).
`crossings` counts the messages that crossed between regions by subject (each `RMSG` a gateway forwards, the
subject as the relay saw it), so a test can count a verb's WAN round trips instead of timing them.

The relays run on their own event loop in a daemon thread, so a test's or `fauxmad dev`'s loop, busy or
blocked, never stalls the supercluster's traffic.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future

import msgspec

from bus.local.ports import free_port

log = logging.getLogger(__name__)

_RMSG = re.compile(rb"(?:^|\r\n)RMSG \S+ (\S+) ")
_FIRST_LINE_LIMIT = 64 * 1024
_CHUNK = 64 * 1024


class _Front(msgspec.Struct, kw_only=True):
    region: str  # the region of the server behind this relay
    host: str
    target_port: int
    listen_port: int


class _Link:
    """One relayed gateway connection: which region it enters, which region dialled it."""

    def __init__(self, front: str, writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]) -> None:
        self.front = front
        self.source: str | None = None
        self.writers = writers

    def touches(self, region: str) -> bool:
        return region in (self.front, self.source)

    def close(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()


def _gateway_of(line: bytes) -> str | None:
    """The `gateway` a dialling server names in its `CONNECT {...}` line, or None."""
    if not line.startswith(b"CONNECT "):
        return None
    try:
        name = json.loads(line[8:].strip()).get("gateway")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


class GatewayRelay:
    def __init__(self, host: str = "127.0.0.1", delay: float = 0.0) -> None:
        self.host = host
        self.delay = delay  # seconds one way (see the top)
        self.crossings: collections.Counter[str] = collections.Counter()
        self._fronts: list[_Front] = []
        self._cut: set[str] = set()
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []

    def front(self, region: str, host: str, target_port: int) -> int:
        """Relay to `host:target_port` (a gateway of `region`); returns the port the relay will listen on: a
        `free_port`, not the kernel's `bind(0)`, whose ephemeral port any outgoing connection of this host may take
        before the relay listens (CI32: a supercluster's routes took one, and every test of the file failed)."""
        port = free_port(self.host)
        self._fronts.append(_Front(region=region, host=host, target_port=target_port, listen_port=port))
        return port

    # -- lifecycle (called from any thread) ---------------------------------------------------------------------
    def start(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        ready: Future[None] = Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
                ready.set_result(None)
            except BaseException as exc:  # a port taken meanwhile: say so in the caller's thread
                ready.set_exception(exc)
                return
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="gateway-relay", daemon=True)
        self._thread.start()
        try:
            ready.result(timeout=10)
        except BaseException:  # nothing listens and no thread runs the loop: `stop` has nothing to stop
            self._thread.join(timeout=10)
            self._loop = None
            loop.close()
            raise

    def cut(self, region: str) -> None:
        self._call(lambda: self._do_cut(region))

    def heal(self, region: str) -> None:
        self._call(lambda: self._cut.discard(region))

    def set_delay(self, seconds: float) -> None:
        """One-way delay from now on (bytes already held keep theirs)."""
        self.delay = seconds

    def cut_regions(self) -> set[str]:
        return set(self._cut)

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        loop.close()

    def _call(self, fn: Callable[[], None]) -> None:
        assert self._loop is not None, "the relay is not running"

        async def go() -> None:
            fn()

        asyncio.run_coroutine_threadsafe(go(), self._loop).result(timeout=10)

    # -- on the relay's loop ---------------------------------------------------------------------------------------
    async def _listen(self) -> None:
        for front in self._fronts:

            async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, front: _Front = front) -> None:
                await self._relay(front, reader, writer)

            self._servers.append(await asyncio.start_server(accept, self.host, front.listen_port))

    def _do_cut(self, region: str) -> None:
        self._cut.add(region)
        for link in [link for link in self._links if link.touches(region)]:
            link.close()
            self._links.discard(link)
        log.info("gateway relay: %s cut off", region)

    async def _relay(self, front: _Front, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if front.region in self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(front.host, front.target_port)
        except OSError:
            writer.transport.abort()
            return
        link = _Link(front.region, (writer, up_writer))
        self._links.add(link)
        back = asyncio.create_task(self._pump(up_reader, writer, link))  # the dialled server speaks first (INFO)
        try:
            first = await reader.readuntil(b"\r\n")
            link.source = _gateway_of(first)
            if link.source in self._cut or front.region in self._cut:
                return
            await self._pump(reader, up_writer, link, first)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            link.close()
            self._links.discard(link)
            back.cancel()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link, first: bytes = b""
    ) -> None:
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:  # in order, each chunk once its delay is over
            while True:
                due, data = await held.get()
                if not data:
                    return
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        delivering = loop.create_task(deliver())
        try:
            data = first or await reader.read(_CHUNK)
            while data:
                self._count(data)
                await held.put((loop.time() + self.delay, data))
                if delivering.done():
                    break
                data = await reader.read(_CHUNK)
            await held.put((0.0, b""))
            await delivering
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            delivering.cancel()
            link.close()

    def _count(self, data: bytes) -> None:
        """Count the `RMSG <account> <subject> ...` lines in `data` by subject (a line split between two reads
        is missed: good enough for counting a verb's messages, whose lines are short)."""
        for match in _RMSG.finditer(data):
            self.crossings[match.group(1).decode(errors="replace")] += 1

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        for link in list(self._links):
            link.close()
        self._links.clear()
        # every connection's pumps and held bytes end here, on the relay's own loop, before it is closed
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
