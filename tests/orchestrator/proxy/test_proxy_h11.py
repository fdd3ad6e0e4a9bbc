"""The edge's request parsing checked against h11, the reference HTTP/1.1 parser (issue 39).

For each request in a corpus (hypothesis-generated heads and bodies, valid and invalid, plus the raw
smuggling cases), the bytes go through what the proxy does to a request (its head found, parsed by
llhttp with the proxy's own rules, the upstream head written, the body re-framed) and, separately,
through h11 as a server. Then:
- what the proxy forwards, h11 accepts, and h11 reads the forwarded request with the same method,
  target, fields and body as the client's (less the fields the proxy owns: framing, hop-by-hop,
  forwarding fields; an absolute-form target as its origin-form with Host from its authority);
- what h11 refuses, the proxy refuses;
- what h11 accepts and the proxy refuses falls under one of the proxy's documented stricter rules
  (`STRICTER`, docs/explanation/edge-parsing.md), never anything else.
No fleet: parsing does no I/O of its own beyond a stream reader, which is fed here.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import h11
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.proxy.forward import send_body, upstream_head
from orchestrator.proxy.http import MAX_HEAD, HttpError
from orchestrator.proxy.request import Body, origin_form, parse_request
from tests.orchestrator.proxy.smuggling_cases import refused_cases

Read = tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]  # method, target, fields, body

# what the proxy owns, so it is not compared: framing (re-framed), hop-by-hop, forwarding fields
OWNED = frozenset(
    {
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authorization",
        b"fauxmad-request-id",
        b"forwarded",
        b"x-real-ip",
        b"fly-client-ip",
    }
)


class _Sink:
    """Collects what the proxy writes upstream (the stream writer's few methods it uses)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.transport = self

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.data += piece

    def get_write_buffer_size(self) -> int:
        return 0

    async def drain(self) -> None:
        return None


def forwarded(data: bytes) -> bytes | None:
    """What the proxy sends the machine for the client's `data` (None: refused)."""

    async def main() -> bytes | None:
        reader = asyncio.StreamReader(limit=MAX_HEAD)
        reader.feed_data(data)
        reader.feed_eof()
        try:
            request = parse_request(await reader.readuntil(b"\r\n\r\n"))
            if request.authority is None:  # the connection handler's rule: no Host, no app
                return None
            sink = _Sink()
            sink.write(upstream_head(request, "192.0.2.1", "0123456789abcdef", False, False))
            await send_body(Body(request, reader, 1.0), sink, chunked=request.framing.chunked)  # type: ignore[arg-type]
        except (HttpError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return None
        return bytes(sink.data)

    return asyncio.run(main())


def h11_reads(data: bytes) -> Read | None:
    """The request h11 reads from `data` whole, head and body (None: it refuses, or it is incomplete)."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    conn.receive_data(b"")
    try:
        event = conn.next_event()
        if not isinstance(event, h11.Request):
            return None
        body = b""
        while True:
            part = conn.next_event()
            if isinstance(part, h11.Data):
                body += part.data
            elif isinstance(part, h11.EndOfMessage):
                return event.method, event.target, list(event.headers), body
            else:
                return None
    except h11.RemoteProtocolError:
        return None


def _as_sent(read: Read) -> Read:
    """The client's request as the machine should get it: owned fields out, absolute-form resolved."""
    method, target, fields, body = read
    named = {t.strip().lower() for n, v in fields if n == b"connection" for t in v.split(b",")}
    kept = [(n, v) for n, v in fields if n not in OWNED and n not in named and not n.startswith(b"x-forwarded-")]
    if re.match(rb"(?i)https?://", target):
        authority = re.split(rb"[/?#]", target.split(b"://", 1)[1])[0]
        kept = [(b"host", authority)] + [(n, v) for n, v in kept if n != b"host"]
        target = origin_form(target)
    return method, target, kept, body


def _as_got(read: Read) -> Read:
    method, target, fields, body = read
    return method, target, [(n, v) for n, v in fields if n not in OWNED and not n.startswith(b"x-forwarded-")], body


def _head(data: bytes) -> bytes:
    end = data.find(b"\r\n\r\n")
    return data if end < 0 else data[: end + 4]


def _fields(data: bytes) -> list[tuple[bytes, bytes]]:
    """The head's fields as h11 would split them (a bare LF ends a line), names lower-cased."""
    lines = re.split(rb"\r?\n", _head(data))[1:]
    out = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if colon:
            out.append((name.strip().lower(), value.strip()))
    return out


def _values(data: bytes, name: bytes) -> list[bytes]:
    return [value for field, value in _fields(data) if field == name]


# The proxy's rules beyond h11's, each with its reason (docs/explanation/edge-parsing.md says them too).
STRICTER: dict[str, Callable[[bytes], bool]] = {
    # in the head, and in a chunked body's lines (the corpus's chunk data hold no CR or LF)
    "a bare LF or CR ends no line": lambda d: (
        re.search(rb"(?<!\r)\n|\r(?!\n)", d if _values(d, b"transfer-encoding") else _head(d)) is not None
    ),
    "only HTTP/1.0 and HTTP/1.1": lambda d: re.match(rb"\S+ \S+ HTTP/1\.[01]\r\n", d) is None,
    "one Content-Length, one value": lambda d: (
        len(_values(d, b"content-length")) > 1 or any(b"," in v for v in _values(d, b"content-length"))
    ),
    "Transfer-Encoding beside Content-Length": lambda d: (
        bool(_values(d, b"transfer-encoding")) and bool(_values(d, b"content-length"))
    ),
    "two Host fields": lambda d: len(_values(d, b"host")) > 1,
    "no Host, no app (HTTP/1.0)": lambda d: not _values(d, b"host"),
    "Connection names a framing field": lambda d: any(
        t.strip().lower() in (b"host", b"content-length", b"transfer-encoding")
        for v in _values(d, b"connection")
        for t in v.split(b",")
    ),
    "a control character in a field value": lambda d: any(
        re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", v) for _, v in _fields(d)
    ),
    "CONNECT is not served": lambda d: d.startswith(b"CONNECT "),
    "no obs-fold (a line begun with whitespace)": lambda d: re.search(rb"\n[ \t]", _head(d)) is not None,
}


def check(data: bytes) -> None:
    sent = forwarded(data)
    reference = h11_reads(data)
    if sent is not None:
        assert reference is not None, f"the proxy forwarded what h11 refuses: {data!r}"
        got = h11_reads(sent)
        assert got is not None, f"h11 cannot read what the proxy forwarded: {sent!r}"
        assert _as_got(got) == _as_sent(reference), data
    elif reference is not None:
        reasons = [name for name, rule in STRICTER.items() if rule(data)]
        assert reasons, f"the proxy refused what h11 accepts, under no documented rule: {data!r}"


METHODS = [b"GET", b"get", b"POST", b"post", b"PUT", b"FOO", b"M-SEARCH", b"G@T", b"G(T", b""]
TARGETS = [b"/", b"/a?b=c", b"/a'b!$&()*+,;=:@~", b'/a"b', b"/a<b>", b"/a{b}|\\^`", b"/\x80", b"/a\tb"]
TARGETS += [b"/a\x00b", b"/a\nb", b"*", b"http://x.localhost/p?q", b"http://x.localhost", b"/a#f", b"//", b"/%zz"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 "]
NAMES = [b"Host", b"host", b"X-A", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Expect"]
NAMES += [b"X-Forwarded-For", b"Forwarded", b"X A", b"X-A ", b"", b"X-\xff", b"!#$%&'*+-.^_`|~", b"Trailer", b"TE"]
VALUES = [b"a.localhost", b"b", b"  b  ", b"", b"5", b"05", b"+5", b"5, 5", b"-1", b"0x5", b"chunked", b"Chunked"]
VALUES += [b"chunked ", b"gzip, chunked", b"chunked, identity", b"identity", b"xchunked", b"close", b"host"]
VALUES += [b"content-length", b"keep-alive, x-a", b"100-continue", b"\x80\xff", b"a\tb", b"a\x7fb", b"a\x00b"]
VALUES += [b"a\rb", b"a\nb", b"a\x0bb", b'"q,"', b"1.2.3.4"]
EOLS = [b"\r\n", b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r"]
BODIES = [b"", b"hello", b"5\r\nhello\r\n0\r\n\r\n", b"5;e=1\r\nhello\r\n0\r\n\r\n", b'5;e="q"\r\nhello\r\n0\r\n\r\n']
BODIES += [b"5\r\nhello\r\n0\r\nT: 1\r\n\r\n", b"A\r\nhellohello\r\n0\r\n\r\n", b"a\r\nhellohello\r\n0\r\n\r\n"]
BODIES += [
    b"05\r\nhello\r\n0\r\n\r\n",
    b"0\r\n\r\n",
    b"5 \r\nhello\r\n0\r\n\r\n",
    b"5\r\nhelloXX0\r\n\r\n",
    b"0x5\r\nhello\r\n0\r\n\r\n",
]
BODIES += [b"5;a\nb\r\nhello\r\n0\r\n\r\n", b"-1\r\nhello", b"5\r\nhello\r\n0\r\nT: a\n\nGET / HTTP/1.1\r\n\r\n"]

field = st.tuples(st.sampled_from(NAMES), st.sampled_from([b":", b": ", b" : "]), st.sampled_from(VALUES))
requests = st.builds(
    lambda method, target, version, fields, eol, body: (
        method
        + b" "
        + target
        + b" "
        + version
        + b"\r\n"
        + b"".join(name + colon + value + eol for name, colon, value in fields)
        + b"\r\n"
        + body
    ),
    st.sampled_from(METHODS),
    st.sampled_from(TARGETS),
    st.sampled_from(VERSIONS),
    st.lists(field, max_size=6),
    st.sampled_from(EOLS),
    st.sampled_from(BODIES),
)
with_host = st.builds(
    lambda data: data.replace(b"\r\n", b"\r\nHost: a.localhost\r\n", 1), requests
)  # most requests carry a Host, so that what they test is what comes after it


# well-formed requests, so that many reach the machine and their fields and bodies are compared
VALID_FIELDS = [b"X-A: b", b"X-B:  spaced  ", b"Accept: */*", b"X-Forwarded-For: 1.2.3.4", b"Forwarded: for=x"]
VALID_FIELDS += [b"Connection: keep-alive", b'X-H: "q,"', b"X-I: \x80\xff", b"X-J: a\tb", b"!#$%&'*+-.^_`|~: x"]
VALID_BODIES = [
    b"",
    b"Content-Length: 0\r\n\r\n",
    b"Content-Length: 5\r\n\r\nhello",
    b"Content-Length: 11\r\n\r\nhello\r\nworld",
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"Transfer-Encoding: Chunked\r\n\r\n5;e=1\r\nhello\r\n6;f\r\n world\r\n0\r\n\r\n",
    b"Transfer-Encoding: chunked\r\n\r\nA\r\nhellohello\r\n0\r\nT: 1\r\n\r\n",
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
]
valid = st.builds(
    lambda method, target, version, fields, body: (
        method
        + b" "
        + target
        + b" "
        + version
        + b"\r\nHost: a.localhost\r\n"
        + b"".join(field + b"\r\n" for field in fields)
        + (body or b"\r\n")
    ),
    st.sampled_from([b"GET", b"get", b"POST", b"PUT", b"FOO", b"M-SEARCH", b"PROPFIND"]),
    st.sampled_from([b"/", b"/a?b=c", b"/a'b!$&()*+,;=:@~", b"//", b"/%zz", b"http://a.localhost/p?q"]),
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]),
    st.lists(st.sampled_from(VALID_FIELDS), max_size=4),
    st.sampled_from(VALID_BODIES),
)


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(valid, requests, with_host))
def test_the_proxy_forwards_exactly_what_h11_accepts(data: bytes) -> None:
    check(data)


def test_the_smuggling_cases_too() -> None:
    for data in refused_cases("recorder").values():
        assert forwarded(data) is None, data
        check(data)
    for data in [
        b"get /lower HTTP/1.1\r\nHost: a.localhost\r\n\r\n",
        b"GET http://b.localhost/abs?q=1 HTTP/1.1\r\nHost: a.localhost\r\n\r\n",
        b"POST /c HTTP/1.1\r\nHost: a.localhost\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\nT: 1\r\n\r\n",
        b"POST /l HTTP/1.1\r\nHost: a.localhost\r\nContent-Length: 5\r\n\r\nhello",
    ]:
        assert forwarded(data) is not None, data
        check(data)
