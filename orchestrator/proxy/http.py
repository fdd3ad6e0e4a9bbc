"""HTTP/1.1 as the proxy needs it for a machine's responses, and what requests and responses share.

Requests, which come from anyone, are parsed by llhttp (`request`). A response comes from the app's own
machine: its head is parsed by llhttp too (strict, and in C: every request's path, where a hand-written
parser cost twice as much), and its body relayed in its own framing (a chunked body goes through as chunks,
parsed only to find its end, each size plain hex and each line ended by one CRLF), so nothing is buffered
whole and streaming works both ways. Both Content-Length and Transfer-Encoding, two Content-Lengths, or
anything else malformed in a response head, are a 502. Parsing does no I/O and is tested by feeding bytes.
"""

from __future__ import annotations

import asyncio
import re
from typing import NamedTuple

import httptools

MAX_HEAD = 32 * 1024  # bytes of request line and headers; more is a 431
MAX_HEADERS = 100
CHUNK = 64 * 1024

# Hop-by-hop headers (RFC 9110 7.6.1): they describe one connection, so they are not forwarded.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"upgrade", b"proxy-authorization"}
)


class HttpError(Exception):
    """A request the proxy refuses before any machine sees it: `status` and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class Head(NamedTuple):
    """A parsed request or response head. `first` is the request line's method or the status code."""

    first: bytes
    target: bytes  # request: the target; response: the reason phrase
    version: bytes  # b"HTTP/1.1"
    headers: list[tuple[bytes, bytes]]  # names lower-cased, values stripped, in order

    def get(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def tokens(self, name: bytes) -> set[bytes]:
        """The comma-separated tokens of every `name` header, lower-cased (Connection, Upgrade)."""
        out: set[bytes] = set()
        for key, value in self.headers:
            if key == name:
                out.update(part.strip().lower() for part in value.split(b","))
        return out


_NOTHING: frozenset[bytes] = frozenset()


class Framing(NamedTuple):
    """Where a body ends: `length` bytes, or chunked, or (responses only) when the connection closes."""

    chunked: bool
    length: int  # -1: until close (responses); 0: none


_NO_BODY = Framing(False, 0)
_CHUNKED = Framing(True, 0)
_UNTIL_CLOSE = Framing(False, -1)
_RESPONSE_FRAMING = frozenset({b"connection", b"content-length", b"transfer-encoding"})


class Response:
    """A machine's response head as llhttp's callbacks fill it, in one pass: status, reason, fields (names
    lower-cased, in order), Connection's tokens, and what frames its body (`framing`, given the method)."""

    __slots__ = ("connection", "encoding", "headers", "lengths", "reason", "status", "version")

    def __init__(self) -> None:
        self.status = 0
        self.version = b"HTTP/1.1"
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.connection = _NOTHING  # lower-cased tokens
        self.encoding: bytes | None = None  # the first Transfer-Encoding field's value
        self.lengths = _NOTHING  # the Content-Length values (llhttp refuses a second one)

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps a value's trailing OWS
        self.headers.append((key, value))
        if key in _RESPONSE_FRAMING:
            if key == b"connection":
                self.connection = self.connection | {part.strip().lower() for part in value.split(b",")}
            elif key == b"content-length":
                self.lengths = self.lengths | {value}
            elif self.encoding is None:
                self.encoding = value

    def framing(self, method: bytes) -> Framing:
        """Both Content-Length and Transfer-Encoding, a coding that does not end in chunked, two different
        lengths or one not all digits: a 502 (the machine's answer could be read two ways)."""
        if not response_has_body(method, self.status):
            return _NO_BODY
        if self.encoding is not None:
            if self.lengths:
                raise HttpError(502, "both Transfer-Encoding and Content-Length")
            if not self.encoding.lower().endswith(b"chunked"):
                raise HttpError(502, "a Transfer-Encoding that does not end in chunked")
            return _CHUNKED
        if not self.lengths:
            return _UNTIL_CLOSE
        if len(self.lengths) > 1:
            raise HttpError(502, "several different Content-Length values")
        (value,) = self.lengths
        if not value.isdigit() or len(value) > 15:
            raise HttpError(502, "an invalid Content-Length")
        return Framing(False, int(value))


def parse_response(data: bytes) -> Response:
    """`data`: a machine's response head up to its blank line, parsed by llhttp in its strict mode (a bare CR
    or LF, a NUL or control character in a field, a name that is not a token, obs-fold, two Content-Lengths,
    both framings: refused), and what it lets through checked here (a version other than HTTP/1.x, a NUL in
    the reason). Anything malformed is a 502: the machine's fault, not the client's."""
    if not data.startswith(b"HTTP/1."):  # llhttp also takes HTTP/2.0, RTSP/ and ICE/
        raise HttpError(502, "the machine's response is not HTTP/1.x")
    response = Response()
    parser = httptools.HttpResponseParser(response)
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:  # a 101: its head is whole, the tunnel's bytes are not fed
        pass
    except httptools.HttpParserError as exc:
        raise HttpError(502, f"the machine's response head is malformed ({exc})") from None
    if b"\x00" in response.reason:
        raise HttpError(502, "the machine's response head has a NUL")
    if len(response.headers) > MAX_HEADERS:
        raise HttpError(502, f"the machine's response has more than {MAX_HEADERS} header fields")
    response.status = parser.get_status_code()
    response.version = data[:8]
    return response


def parse_response_head(data: bytes) -> Head:
    """A machine's response head as a `Head` (`first`: the status code, `target`: the reason)."""
    response = parse_response(data)
    return Head(b"%d" % response.status, response.reason, response.version, response.headers)


def response_has_body(method: bytes, status: int) -> bool:
    return not (method == b"HEAD" or status in (204, 304) or 100 <= status < 200)


_HOSTS: dict[tuple[bytes, str], str | None] = {}  # split_host's answers: the same few hosts come on every request


def split_host(host: bytes | None, domain: str) -> str | None:
    """The app a Host header names under `domain` (`sandwich.localhost:8080` -> `sandwich`), or None."""
    if not host:
        return None
    key = (host, domain)
    try:
        return _HOSTS[key]
    except KeyError:
        pass
    app = _split_host(host, domain)
    if len(host) <= 256:  # made-up hosts grow it to 4,096 short keys at most
        if len(_HOSTS) >= 4096:
            _HOSTS.clear()
        _HOSTS[key] = app
    return app


def _split_host(host: bytes, domain: str) -> str | None:
    try:
        text = host.decode("ascii").lower()
    except UnicodeDecodeError:
        return None
    name = text.rsplit(":", 1)[0] if not text.endswith("]") else text
    suffix = "." + domain.lower()
    if not name.endswith(suffix):
        return None
    app = name[: -len(suffix)]
    if not app or len(app) > 64 or not all(c.isalnum() or c in "-_" for c in app):
        return None
    return app


async def copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, length: int) -> None:
    remaining = length
    while remaining:
        data = await reader.read(min(CHUNK, remaining))
        if not data:
            raise asyncio.IncompleteReadError(b"", remaining)
        remaining -= len(data)
        writer.write(data)
        if writer.transport.get_write_buffer_size() > CHUNK:
            await writer.drain()


_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


def _line_ok(line: bytes) -> bool:
    """A chunk line or trailer from a machine: one CRLF, at its end, and no NUL."""
    inner = line[:-2]
    return b"\r" not in inner and b"\n" not in inner and b"\x00" not in inner


async def copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Relay a machine's chunked response as it comes, chunk by chunk, trailers included: each chunk size
    plain hex, each line ended by one CRLF (else a 502: the client's connection is cut)."""
    while True:
        line = await reader.readuntil(b"\r\n")
        size_text = line[:-2].split(b";", 1)[0]
        if _CHUNK_SIZE.fullmatch(size_text) is None or not _line_ok(line):
            raise HttpError(502, "the machine sent a malformed chunk size")
        size = int(size_text, 16)
        writer.write(line)
        if size == 0:
            while True:  # trailers, then the blank line
                trailer = await reader.readuntil(b"\r\n")
                if not _line_ok(trailer):
                    raise HttpError(502, "the machine sent a malformed trailer")
                writer.write(trailer)
                if trailer == b"\r\n":
                    await writer.drain()
                    return
        await copy_exact(reader, writer, size)
        crlf = await reader.readexactly(2)
        if crlf != b"\r\n":
            raise HttpError(502, "the machine sent a malformed chunk")
        writer.write(crlf)
        await writer.drain()


async def copy_until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(CHUNK):
        writer.write(data)
        await writer.drain()


async def relay_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, framing: Framing) -> None:
    if framing.chunked:
        await copy_chunked(reader, writer)
    elif framing.length > 0:
        await copy_exact(reader, writer, framing.length)
    elif framing.length < 0:
        await copy_until_close(reader, writer)


REASONS = {
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


def error_response(status: int, message: str, request_id: str, *, retry_after: int | None = None) -> bytes:
    """A complete response the proxy writes itself (then closes the connection): plain text, one line."""
    body = (message + "\n").encode()
    extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    return (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
        f"content-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
        f"fauxmad-request-id: {request_id}\r\n{extra}connection: close\r\n\r\n"
    ).encode() + body
