"""A request forwarded to the machine chosen for it, and its answer relayed to the client.

The request head goes upstream rewritten (hop-by-hop headers dropped, `x-forwarded-*` and
`fauxmad-request-id` added, always HTTP/1.1 so the machine's connection stays reusable), the body
alongside (full duplex: the response may begin before the body ends), and the response comes back with
`fauxmad-request-id` and `fauxmad-machine`. A `101` to an upgrade becomes a tunnel both ways. A kept
connection the machine closed meanwhile is tried once more on a new one when the request is safe to
send twice. A machine that fails before its response began is `UpstreamFailed` (the connection handler
decides whether another machine gets the request); one that does not answer in time is a 504.
"""

from __future__ import annotations

import asyncio
import contextlib

from orchestrator.proxy.ahead import head_once_resumed, resumed
from orchestrator.proxy.config import ProxyConfig, machine_port
from orchestrator.proxy.exchange import Exchange, Refused
from orchestrator.proxy.http import (
    CHUNK,
    HOP_BY_HOP,
    Framing,
    Head,
    body_framing,
    parse_response_head,
    relay_body,
    response_has_body,
)
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Conn, Pool


class UpstreamFailed(Exception):
    """The machine failed before its response began; `resend`: sending the request again is safe."""

    def __init__(self, why: str, *, resend: bool) -> None:
        super().__init__(why)
        self.resend = resend


class Forwarder:
    def __init__(self, config: ProxyConfig, routes: RouteTable, pool: Pool) -> None:
        self.config = config
        self.routes = routes
        self.pool = pool

    async def forward(
        self,
        ex: Exchange,
        app: App,
        machine_id: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_ip: str,
        upgrade: bool,
        *,
        fresh: bool,
    ) -> None:
        entry = self.routes.entry(machine_id)
        if entry is None or not (app.service.internal_port or entry.port):
            raise UpstreamFailed(f"{machine_id} has no known port", resend=True)
        ex.machine, ex.region = machine_id, entry.region
        address = self.pool.address(entry, machine_port(app, entry))
        try:
            conn = await self.pool.get(address, fresh=fresh)
        except OSError as exc:
            raise UpstreamFailed(f"{machine_id}: {exc.strerror or exc}", resend=True) from None
        try:
            await self._exchange(ex, conn, reader, writer, client_ip, upgrade)
            return
        except UpstreamFailed:
            conn.close()
            if ex.waking is not None:  # the kept connection failed before the resume answered: wait for it
                await resumed(ex)
            if not (conn.reused and ex.safe):
                raise
        except BaseException:
            conn.close()
            raise
        # a kept connection the machine had closed meanwhile: once more on a new one, same machine
        try:
            conn = await self.pool.get(address, fresh=True)
        except OSError as exc:
            raise UpstreamFailed(f"{machine_id}: {exc.strerror or exc}", resend=True) from None
        try:
            await self._exchange(ex, conn, reader, writer, client_ip, upgrade)
        except BaseException:
            conn.close()
            raise

    async def _exchange(
        self,
        ex: Exchange,
        conn: Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_ip: str,
        upgrade: bool,
    ) -> None:
        head = ex.head
        conn.writer.write(_upstream_head(head, client_ip, ex.request_id, upgrade))
        sending: asyncio.Future[None] | None = None
        if ex.framing.chunked or ex.framing.length > 0:  # full duplex: the response may begin before the body ends
            sending = asyncio.ensure_future(relay_body(reader, conn.writer, ex.framing))
        try:
            await self._respond(ex, conn, reader, writer, upgrade)
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()

    async def _respond(
        self, ex: Exchange, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upgrade: bool
    ) -> None:
        head = ex.head
        ex.watch.arm(self.config.response_timeout)
        try:
            data = await (head_once_resumed(ex, conn) if ex.waking else conn.reader.readuntil(b"\r\n\r\n"))
        except asyncio.CancelledError:
            if not ex.watch.expired():
                raise
            raise Refused(
                504, f"machine {ex.machine} did not answer within {self.config.response_timeout:g}s"
            ) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise UpstreamFailed(f"{ex.machine} closed the connection ({type(exc).__name__})", resend=False) from None
        finally:
            ex.watch.disarm()
        response = parse_response_head(data)
        status = int(response.first)
        while 100 <= status < 200 and status != 101:  # interim responses (100 Continue): pass on, read on
            writer.write(data)
            data = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), self.config.response_timeout)
            response = parse_response_head(data)
            status = int(response.first)
        ex.status = status
        if status == 101 and upgrade:
            ex.client_keep = False
            ex.responded = True
            writer.write(data)
            await _tunnel(reader, writer, conn)
            return
        framing = body_framing(response, request=False) if response_has_body(head.first, status) else Framing(False, 0)
        upstream_keep = b"close" not in response.tokens(b"connection") and framing.length >= 0
        if response.version != b"HTTP/1.1":
            upstream_keep = upstream_keep and b"keep-alive" in response.tokens(b"connection")
        if framing.length < 0:
            ex.client_keep = False
        client_head = _client_head(response, ex, machine=ex.machine or "")
        if not framing.chunked and 0 < framing.length <= CHUNK:  # a small body: head and body in one send
            body = await conn.reader.readexactly(framing.length)
            ex.responded = True
            writer.write(client_head + body)
        else:
            ex.responded = True
            writer.write(client_head)
            await relay_body(conn.reader, writer, framing)
        if upstream_keep:
            self.pool.put(conn)
        else:
            conn.close()
        if writer.transport.get_write_buffer_size():
            await writer.drain()


def _dropped(head: Head, upgrade: bool) -> set[bytes]:
    drop = set(HOP_BY_HOP) | head.tokens(b"connection")
    if upgrade:
        drop -= {b"upgrade"}
    return drop


def _upstream_head(head: Head, client_ip: str, request_id: str, upgrade: bool) -> bytes:
    drop = _dropped(head, upgrade) | {b"x-forwarded-proto", b"x-forwarded-host", b"fauxmad-request-id"}
    lines = [head.first, b" ", head.target, b" HTTP/1.1\r\n"]
    forwarded_for = client_ip.encode()
    for name, value in head.headers:
        if name in drop:
            continue
        if name == b"x-forwarded-for":
            forwarded_for = value + b", " + forwarded_for
            continue
        lines += [name, b": ", value, b"\r\n"]
    lines += [b"x-forwarded-for: ", forwarded_for, b"\r\nx-forwarded-proto: http\r\n"]
    host = head.get(b"host")
    if host is not None:
        lines += [b"x-forwarded-host: ", host, b"\r\n"]
    lines += [b"fauxmad-request-id: ", request_id.encode(), b"\r\n"]
    if upgrade:
        lines.append(b"connection: upgrade\r\n")
    if head.version == b"HTTP/1.0" and not upgrade:
        pass  # spoken upstream as HTTP/1.1: the machine's connection stays reusable
    lines.append(b"\r\n")
    return b"".join(lines)


def _client_head(response: Head, ex: Exchange, *, machine: str) -> bytes:
    drop = set(HOP_BY_HOP) | response.tokens(b"connection")
    lines = [b"HTTP/1.1 ", response.first, b" ", response.target, b"\r\n"]
    for name, value in response.headers:
        if name not in drop:
            lines += [name, b": ", value, b"\r\n"]
    lines += [b"fauxmad-request-id: ", ex.request_id.encode(), b"\r\nfauxmad-machine: ", machine.encode()]
    lines.append(b"\r\nconnection: keep-alive\r\n\r\n" if ex.client_keep else b"\r\nconnection: close\r\n\r\n")
    return b"".join(lines)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.write_eof()


async def _tunnel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Conn) -> None:
    """After `101 Switching Protocols` (WebSocket): bytes both ways until either side is done."""
    up = asyncio.ensure_future(_pipe(reader, conn.writer))
    down = asyncio.ensure_future(_pipe(conn.reader, writer))
    try:
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down):
            task.cancel()
        conn.close()
