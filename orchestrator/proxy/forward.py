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
import functools
import ipaddress
from typing import Any

from orchestrator.proxy.ahead import head_once_resumed, resumed
from orchestrator.proxy.config import ProxyConfig, machine_port
from orchestrator.proxy.exchange import Exchange, Refused
from orchestrator.proxy.http import CHUNK, HOP_BY_HOP, Head, HttpError, Response, parse_response, relay_body
from orchestrator.proxy.request import Body, Request, origin_form
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Address, Conn, Pool


class UpstreamFailed(Exception):
    """The machine failed before its response began; `resend`: sending the request again is safe; `refused`: its
    connection was refused (by the machine, or by its worker for it), so nothing reached it."""

    def __init__(self, why: str, *, resend: bool, refused: bool = False) -> None:
        super().__init__(why)
        self.resend = resend
        self.refused = refused


class Forwarder:
    def __init__(self, config: ProxyConfig, routes: RouteTable, pool: Pool) -> None:
        self.config = config
        self.routes = routes
        self.pool = pool
        self.trusted = tuple(ipaddress.ip_network(cidr, strict=False) for cidr in config.trusted_proxies)

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
        conn = await self._connection(address, machine_id, fresh)
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
        conn = await self._connection(address, machine_id, True)
        try:
            await self._exchange(ex, conn, reader, writer, client_ip, upgrade)
        except BaseException:
            conn.close()
            raise

    async def _connection(self, address: Address, machine_id: str, fresh: bool) -> Conn:
        """A connection to the machine (kept or `fresh`), which then counts as bound; one it could not get is an
        `UpstreamFailed` that says whether it was refused (nothing reached the machine)."""
        try:
            conn = await self.pool.get(address, fresh=fresh)
        except OSError as exc:
            refused = isinstance(exc, ConnectionRefusedError)
            raise UpstreamFailed(f"{machine_id}: {exc.strerror or exc}", resend=True, refused=refused) from None
        self.routes.bound(machine_id)
        return conn

    async def _exchange(
        self,
        ex: Exchange,
        conn: Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_ip: str,
        upgrade: bool,
    ) -> None:
        conn.writer.write(upstream_head(ex.request, client_ip, ex.request_id, upgrade, self.trusts(client_ip)))
        sending: asyncio.Future[None] | None = None
        framing = ex.framing
        if framing.chunked or framing.length > 0:  # full duplex: the response may begin before the body ends
            body = Body(ex.request, reader, self.config.head_timeout)
            sending = asyncio.ensure_future(send_body(body, conn.writer, chunked=framing.chunked))
            task = asyncio.current_task()
            assert task is not None
            ex.uploading = True
            sending.add_done_callback(functools.partial(_upload_done, ex, task))
        try:
            await self._respond(ex, conn, reader, writer, upgrade, sending)
        except asyncio.CancelledError:
            failure = ex.body_error
            if failure is None:
                raise
            ex.body_error = None
            if task := asyncio.current_task():
                task.uncancel()
            raise failure from None
        finally:
            ex.uploading = False
            if sending is not None and not sending.done():
                sending.cancel()

    def trusts(self, client_ip: str) -> bool:
        """Whether the client is a configured trusted hop (its forwarding headers are kept and extended)."""
        if not self.trusted:
            return False
        try:
            address = ipaddress.ip_address(client_ip)
        except ValueError:
            return False
        return any(address in network for network in self.trusted)

    async def _respond(
        self,
        ex: Exchange,
        conn: Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        upgrade: bool,
        sending: asyncio.Future[None] | None,
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
        response = parse_response(data)
        status = response.status
        while 100 <= status < 200 and status != 101:  # interim responses (100 Continue): pass on, read on
            writer.write(data)
            data = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), self.config.response_timeout)
            response = parse_response(data)
            status = response.status
        ex.status = status
        if status == 101 and upgrade:
            ex.client_keep = False
            ex.responded = True
            writer.write(data)
            await _tunnel(reader, writer, conn)
            return
        framing = response.framing(head.first)
        connection = response.connection
        upstream_keep = b"close" not in connection and framing.length >= 0
        if response.version != b"HTTP/1.1":
            upstream_keep = upstream_keep and b"keep-alive" in connection
        if framing.length < 0:
            ex.client_keep = False
        if not framing.chunked and 0 <= framing.length <= CHUNK:  # a small body: head and body in one send
            body = await conn.reader.readexactly(framing.length) if framing.length else b""
            if sending is not None and not sending.done():
                await asyncio.sleep(0)  # the upload's last write may be done, its task not yet resumed
            if sending is not None and not sending.done():
                # a whole response before the whole upload: neither connection can carry another request
                ex.client_keep = False
            ex.responded = True
            writer.write(_client_head(response, ex, machine=ex.machine or "") + body)
        else:  # a streamed response (full duplex: the upload may go on meanwhile); the end decides the connections
            ex.responded = True
            writer.write(_client_head(response, ex, machine=ex.machine or ""))
            await relay_body(conn.reader, writer, framing)
        self._release(ex, conn, upstream_keep, sending)
        if writer.transport.get_write_buffer_size():
            await writer.drain()

    def _release(self, ex: Exchange, conn: Conn, keep: bool, sending: asyncio.Future[None] | None) -> None:
        """The machine's connection back to the pool only when both directions are complete: after an early
        response the rest of the upload is not sent, and the connection (and the client's) ends instead."""
        if sending is not None and not (sending.done() and not sending.cancelled() and sending.exception() is None):
            keep = ex.client_keep = False
        if keep:
            self.pool.put(conn)
        else:
            conn.close()


# fields that say who the client is or how it came: believed only from a trusted hop (`--trusted-proxy`)
_FORWARDING = frozenset({b"forwarded", b"x-real-ip", b"fly-client-ip"})
_REFRAMED = frozenset({b"content-length", b"transfer-encoding", b"fauxmad-request-id"})
_DROP = HOP_BY_HOP | _REFRAMED  # what no request's head keeps (built once: this is every request's path)
_DROP_ABSOLUTE = _DROP | {b"host"}  # an absolute-form target's authority is the Host
_UPGRADE = frozenset({b"upgrade"})


def upstream_head(request: Request, client_ip: str, request_id: str, upgrade: bool, trusted: bool) -> bytes:
    """The head the machine gets: hop-by-hop fields dropped, the body's framing the proxy's own, forwarding
    fields from an untrusted client dropped and written anew, an absolute-form target in origin-form with
    its authority as Host (RFC 9112 §3.2.2), always HTTP/1.1 (the machine's connection stays reusable)."""
    head = request.head
    drop = _DROP_ABSOLUTE if request.absolute else _DROP
    named = head.tokens(b"connection")  # hop-by-hop too (RFC 9110 §7.6.1), but Upgrade on an upgrade
    if named or upgrade:
        drop = (drop | named) - _UPGRADE if upgrade else drop | named
    target = origin_form(head.target) if request.absolute else head.target
    lines = [head.first, b" ", target, b" HTTP/1.1\r\n"]
    authority = request.authority
    if request.absolute and authority is not None:
        lines += [b"host: ", authority, b"\r\n"]
    forwarded_for, kept = _fields(lines, head, drop, client_ip.encode(), trusted)
    framing = request.framing
    if framing.chunked:
        lines.append(b"transfer-encoding: chunked\r\n")
    elif framing.length or head.get(b"content-length") is not None:
        lines += [b"content-length: ", str(framing.length).encode(), b"\r\n"]
    lines += [b"x-forwarded-for: ", forwarded_for, b"\r\n"]
    if b"x-forwarded-proto" not in kept:
        lines.append(b"x-forwarded-proto: http\r\n")
    if authority is not None and b"x-forwarded-host" not in kept:
        lines += [b"x-forwarded-host: ", authority, b"\r\n"]
    lines += [b"fauxmad-request-id: ", request_id.encode(), b"\r\n"]
    if upgrade:
        lines.append(b"connection: upgrade\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def _fields(
    lines: list[bytes], head: Head, drop: frozenset[bytes], forwarded_for: bytes, trusted: bool
) -> tuple[bytes, set[bytes]]:
    """The client's fields into `lines`, but those dropped, and forwarding fields only from a trusted hop;
    (the X-Forwarded-For to send, the forwarding fields kept)."""
    kept: set[bytes] = set()
    for name, value in head.headers:
        if name in drop:
            continue
        if name in _FORWARDING or name.startswith(b"x-forwarded-"):
            if not trusted:
                continue
            if name == b"x-forwarded-for":
                forwarded_for = value + b", " + forwarded_for
                continue
            kept.add(name)
        lines += [name, b": ", value, b"\r\n"]
    return forwarded_for, kept


async def send_body(body: Body, writer: asyncio.StreamWriter, *, chunked: bool) -> None:
    """The request's body to the machine, framed anew from what llhttp parsed (a length, or our own chunks)."""
    async for data in body.pieces():
        if chunked:
            writer.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            writer.write(data)
        if writer.transport.get_write_buffer_size() > CHUNK:
            await writer.drain()
    if chunked:
        writer.write(b"0\r\n\r\n")
    await writer.drain()


def _upload_done(ex: Exchange, task: asyncio.Task[Any], sending: asyncio.Future[None]) -> None:
    """A client body that failed (malformed, stalled, cut) is answered at once: the wait for the response
    is cancelled and the exchange ends with the body's error (a 400 or 408 when nothing was sent yet)."""
    if sending.cancelled() or not ex.uploading:
        return
    failure = sending.exception()
    if isinstance(failure, HttpError) and ex.body_error is None:
        ex.body_error = failure
        task.cancel()


def _client_head(response: Response, ex: Exchange, *, machine: str) -> bytes:
    drop = HOP_BY_HOP | response.connection if response.connection else HOP_BY_HOP
    lines = [b"HTTP/1.1 %d " % response.status, response.reason, b"\r\n"]
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
