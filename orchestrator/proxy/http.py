"""HTTP/1.1 as the proxy needs it for a machine's responses, and what requests and responses share.

Requests, which come from anyone, are parsed by llhttp (`request`). A response comes from the app's own
machine: its head is parsed here, and its body relayed in its own framing (a chunked body goes through as
chunks, parsed only to find its end, each size plain hex and each line ended by one CRLF), so nothing is
buffered whole and streaming works both ways. Both Content-Length and Transfer-Encoding, or two
different lengths, are a 502. Parsing does no I/O and is tested by feeding bytes.
"""

from __future__ import annotations

import asyncio
import re
from typing import NamedTuple

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


# A field name is a token (RFC 9110 5.1): no whitespace (before the colon, a smuggling vector), no separators.
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _headers(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    if len(lines) > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header fields")
    headers = []
    field = _FIELD_NAME.fullmatch
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or field(name) is None:
            raise HttpError(400, "malformed header field")
        headers.append((name.lower(), value.strip()))
    return headers


def parse_response_head(data: bytes) -> Head:
    text = data[:-4]
    pairs = text.count(b"\r\n")
    if b"\x00" in text or text.count(b"\n") != pairs or text.count(b"\r") != pairs:
        raise HttpError(502, "the machine's response head has a bare CR or LF, or a NUL")
    lines = text.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise HttpError(502, "the machine's response is not HTTP/1.x")
    return Head(code, reason, version, _headers(lines[1:]))


class Framing(NamedTuple):
    """Where a body ends: `length` bytes, or chunked, or (responses only) when the connection closes."""

    chunked: bool
    length: int  # -1: until close (responses); 0: none


def body_framing(head: Head, *, request: bool) -> Framing:
    te = head.get(b"transfer-encoding")
    lengths = {value for key, value in head.headers if key == b"content-length"}
    if te is not None:
        if lengths:
            raise HttpError(400 if request else 502, "both Transfer-Encoding and Content-Length")
        if not te.lower().endswith(b"chunked"):
            raise HttpError(400 if request else 502, "a Transfer-Encoding that does not end in chunked")
        return Framing(True, 0)
    if len(lengths) > 1:
        raise HttpError(400 if request else 502, "several different Content-Length values")
    if lengths:
        value = lengths.pop()
        if not value.isdigit() or len(value) > 15:
            raise HttpError(400 if request else 502, "an invalid Content-Length")
        return Framing(False, int(value))
    return Framing(False, 0 if request else -1)


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
