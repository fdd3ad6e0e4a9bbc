"""A client's request as the edge reads it: its head and its body, parsed by llhttp (through httptools).

The edge stands between many clients and kept connections to machines, so a request it reads one way and
a machine reads another is a request smuggled past it (RFC 9112 §11.2). Field syntax, framing, chunk
sizes, chunk terminators and trailers are therefore judged by llhttp, Node's parser, in its strict mode,
not by code of our own; the body goes upstream re-framed from what llhttp parsed (a length, or chunks the
proxy writes itself), never as the client's bytes. On top of llhttp, one strict rule for whatever two
readers could disagree on (RFC 9112 §6.3): a 400, and the connection is closed, for
- a bare CR, a bare LF or a NUL anywhere in the head, a chunk line or a trailer;
- a chunk size that is not plain hex, a chunk not ended by CRLF;
- a Transfer-Encoding that is not exactly `chunked`, or one beside a Content-Length;
- two Host fields, or a Connection field that names Host, Content-Length or Transfer-Encoding;
- a request target with a control character.

llhttp knows a fixed list of methods; any other token (RFC 9110 §9.1: `get` is not `GET`) is parsed in
a stand-in's place and forwarded as written. The head is found by the proxy (`\\r\\n\\r\\n`, within
`MAX_HEAD`), each chunk line and trailer line too, so that llhttp never reads past the request it
parses and a pipelined next request stays in the connection's buffer. Trailers are parsed, checked and
dropped (RFC 9110 §6.5.1 lets an intermediary discard them).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import NamedTuple

import httptools

from orchestrator.proxy.http import CHUNK, MAX_HEAD, MAX_HEADERS, Framing, Head, HttpError

# methods llhttp parses itself; any other token goes to it as a stand-in (GET parses the same way)
_KNOWN_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE"})
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_IN_CONNECTION = frozenset({b"host", b"content-length", b"transfer-encoding"})
_FRAMING = frozenset({b"host", b"connection", b"content-length", b"transfer-encoding"})  # the fields checked
MAX_LENGTH_DIGITS = 15  # a Content-Length of up to a petabyte


class _Fields:
    """llhttp's callbacks for one request: the target, the fields, and where it has got to."""

    __slots__ = ("chunks", "ended", "framing", "headers", "in_body", "target", "trailer_bytes")

    def __init__(self) -> None:
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.framing: list[tuple[bytes, bytes]] = []  # Host, Connection, Transfer-Encoding, Content-Length
        self.in_body = False
        self.ended = False
        self.chunks = 0  # chunk heads parsed
        self.trailer_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_body:  # a trailer: parsed and checked by llhttp, then dropped
            self.trailer_bytes += len(name) + len(value)
            if self.trailer_bytes > MAX_HEAD:
                raise HttpError(431, f"trailers over {MAX_HEAD} bytes")
            return
        if len(self.headers) >= MAX_HEADERS:
            raise HttpError(431, f"more than {MAX_HEADERS} header fields")
        field = (name.lower(), value.rstrip(b" \t"))  # llhttp keeps a value's trailing OWS
        self.headers.append(field)
        if field[0] in _FRAMING:
            self.framing.append(field)

    def on_headers_complete(self) -> None:
        self.in_body = True

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_message_complete(self) -> None:
        self.ended = True


class Request(NamedTuple):
    """A parsed request head: the head, how its body is framed, the authority it names, and its parser."""

    head: Head
    framing: Framing
    authority: bytes | None  # the Host, or an absolute-form target's authority (which wins: RFC 9112 §3.2.2)
    absolute: bool  # the target was absolute-form (it goes upstream in origin-form, with Host from it)
    upgrade: bool  # llhttp saw a protocol upgrade (Connection: upgrade and Upgrade)
    parser: httptools.HttpRequestParser
    fields: _Fields


def _feed(parser: httptools.HttpRequestParser, data: bytes) -> bool:
    """Feed llhttp; True when it stops for a protocol upgrade. Its refusal becomes a 400 naming it."""
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        return True
    except httptools.HttpParserCallbackError as exc:
        if isinstance(exc.__context__, HttpError):
            raise exc.__context__ from None
        raise HttpError(400, f"malformed request ({exc})") from None
    except httptools.HttpParserError as exc:
        raise HttpError(400, f"malformed request ({exc})") from None
    return False


def parse_request(data: bytes) -> Request:
    """`data`: one head, from the request line up to and including its blank line."""
    space = data.find(b" ")
    method = data[:space]
    known = method in _KNOWN_METHODS
    if not known:
        if space <= 0 or _TOKEN.fullmatch(method) is None:
            raise HttpError(400, "malformed request line")
        if method == b"CONNECT":
            raise HttpError(400, "CONNECT is not served here")
    fields = _Fields()
    parser = httptools.HttpRequestParser(fields)
    upgrade = _feed(parser, data if known else b"GET" + data[space:])
    if not fields.in_body:
        raise HttpError(400, "malformed request head")
    version = _version(parser)
    head = Head(method, fields.target, b"HTTP/1.1" if version == "1.1" else b"HTTP/1.0", fields.headers)
    hosts: list[bytes] = []
    encodings: list[bytes] = []
    lengths: list[bytes] = []
    for name, value in fields.framing:  # usually Host alone
        if name == b"host":
            hosts.append(value)
        elif name == b"transfer-encoding":
            encodings.append(value)
        elif name == b"content-length":
            lengths.append(value)
        elif {token.strip().lower() for token in value.split(b",")} & _NOT_IN_CONNECTION:
            raise HttpError(400, "a Connection field naming Host, Content-Length or Transfer-Encoding")
    if len(hosts) > 1:
        raise HttpError(400, "two Host fields")
    if version == "1.1" and not hosts:  # even beside an absolute-form target (RFC 9112 §3.2)
        raise HttpError(400, "a Host header is required")
    framing = _framing(encodings, lengths) if encodings or lengths else _NO_BODY
    absolute = None if fields.target[:1] == b"/" else _authority(fields.target)
    authority = absolute if absolute is not None else (hosts[0] if hosts else None)
    return Request(head, framing, authority, absolute is not None, upgrade, parser, fields)


_NO_BODY = Framing(False, 0)


def _version(parser: httptools.HttpRequestParser) -> str:
    version = parser.get_http_version()
    if version == "0.9":  # llhttp's reading of a request line without a version
        raise HttpError(400, "malformed request line")
    if version not in ("1.1", "1.0"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are spoken here")
    return version


def _framing(encodings: list[bytes], lengths: list[bytes]) -> Framing:
    if encodings:
        if lengths:  # llhttp refuses it too; said here so that no path forwards both
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        if len(encodings) > 1 or encodings[0].lower() != b"chunked":
            raise HttpError(400, "a Transfer-Encoding other than chunked")
        return Framing(True, 0)
    value = lengths[0]  # llhttp refuses a second one, and any but digits
    if len(lengths) > 1 or not value.isdigit() or len(value) > MAX_LENGTH_DIGITS:
        raise HttpError(400, "an invalid Content-Length")
    return Framing(False, int(value))


def _authority(target: bytes) -> bytes | None:
    """The authority of an absolute-form target (`http://app.localhost/x` -> `app.localhost`), else None."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return None
    end = len(rest)
    for stop in (b"/", b"?", b"#"):
        at = rest.find(stop)
        if 0 <= at < end:
            end = at
    authority = rest[:end]
    if b"@" in authority:
        raise HttpError(400, "userinfo in the request target")
    return authority


def origin_form(target: bytes) -> bytes:
    """An absolute-form target as the machine gets it: its path and query (`/` when it has none)."""
    rest = target.partition(b"://")[2]
    for at, char in enumerate(rest):
        if char in b"/?":
            path = rest[at:].partition(b"#")[0]
            return path if path.startswith(b"/") else b"/" + path
    return b"/"


def _chunk_size(line: bytes) -> int:
    """The size of a chunk line llhttp has accepted (plain hex digits, maybe extensions, CRLF)."""
    end = line.find(b";")
    return int(line[:end] if end >= 0 else line[:-2], 16)


class Body:
    """A request's body as llhttp parses it, piece by piece: `pieces()` yields the data (de-chunked).

    `idle` bounds each read: a body that stops arriving is a 408 within `idle` seconds, not a machine left
    waiting for it until the response timeout."""

    def __init__(self, request: Request, reader: asyncio.StreamReader, idle: float) -> None:
        self.request = request
        self.reader = reader
        self.idle = idle

    async def _read(self, n: int) -> bytes:
        try:
            async with asyncio.timeout(self.idle):
                data = await self.reader.read(n)
        except TimeoutError:
            raise HttpError(408, f"the request body stopped arriving ({self.idle:g}s without a byte)") from None
        if not data:
            raise HttpError(400, "the request body ended early")
        return data

    async def _line(self) -> bytes:
        try:
            async with asyncio.timeout(self.idle):
                return await self.reader.readuntil(b"\n")
        except TimeoutError:
            raise HttpError(408, f"the request body stopped arriving ({self.idle:g}s without a byte)") from None
        except asyncio.IncompleteReadError:
            raise HttpError(400, "the request body ended early") from None
        except asyncio.LimitOverrunError:
            raise HttpError(400, "a chunk line or trailer too long") from None

    async def pieces(self) -> AsyncIterator[bytes]:
        framing = self.request.framing
        if framing.chunked:
            async for data in self._chunks():
                yield data
            return
        remaining = framing.length
        while remaining:
            data = await self._read(min(CHUNK, remaining))
            remaining -= len(data)
            yield data

    async def _chunks(self) -> AsyncIterator[bytes]:
        parser, fields = self.request.parser, self.request.fields
        while True:
            line = await self._line()  # a chunk size line, a trailer, or the blank line that ends them
            chunks = fields.chunks
            _feed(parser, line)
            if fields.ended:
                return
            if fields.chunks == chunks:  # a trailer
                continue
            size = _chunk_size(line)
            if size == 0:
                continue  # the last chunk: its trailers and blank line follow
            while size:
                data = await self._read(min(CHUNK, size))
                _feed(parser, data)
                size -= len(data)
                yield data
            terminator = b""
            while len(terminator) < 2:  # llhttp judges it (a CRLF, nothing else)
                piece = await self._read(2 - len(terminator))
                _feed(parser, piece)
                terminator += piece
