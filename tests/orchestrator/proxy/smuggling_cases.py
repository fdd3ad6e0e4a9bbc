"""The raw smuggling cases of issue 39, shared by the end-to-end test (test_proxy_smuggling) and the
differential one (test_proxy_h11): each a request the edge must refuse with a 400, sent to `<app>.localhost`.
"""

from __future__ import annotations


def host(app: str) -> bytes:
    return f"Host: {app}.localhost\r\n".encode()


def hidden(app: str) -> bytes:
    return b"GET /smuggled HTTP/1.1\r\n" + host(app) + b"X-Forwarded-For: 6.6.6.6\r\n\r\n"


def refused_cases(app: str) -> dict[str, bytes]:
    """Each must be a 400 with the connection closed, and the machine must parse nothing of it."""
    h = host(app)
    smuggled = hidden(app)
    body = b"0\r\n\r\n" + smuggled
    chunked = b"POST /upload HTTP/1.1\r\n" + h + b"Transfer-Encoding: chunked\r\n\r\n"
    return {
        "bare LF hides a Transfer-Encoding": b"POST /upload HTTP/1.1\r\n"
        + h
        + b"Content-Length: %d\r\nX-A: b\nTransfer-Encoding: chunked\r\n\r\n" % len(body)
        + body,
        "bare LF injects a field": b"GET /a HTTP/1.1\r\n" + h + b"X-A: a\nX-Injected: yes\r\n\r\n",
        "bare CR in a value": b"GET /a HTTP/1.1\r\n" + h + b"X-A: a\rb\r\n\r\n",
        "NUL in a value": b"GET /a HTTP/1.1\r\n" + h + b"X-A: a\x00b\r\n\r\n",
        "Connection: content-length": b"POST /upload HTTP/1.1\r\n"
        + h
        + b"Connection: content-length\r\nContent-Length: %d\r\n\r\n" % len(smuggled)
        + smuggled,
        "Connection: transfer-encoding": b"POST /upload HTTP/1.1\r\n"
        + h
        + b"Connection: transfer-encoding\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(smuggled), smuggled),
        "Connection: host": b"GET /a HTTP/1.1\r\n" + h + b"Connection: host\r\n\r\n",
        "chunk size 0x3d": chunked + b"0x3d\r\n" + b"a" * 61 + b"\r\n0\r\n\r\n",
        "chunk size 1_0": chunked + b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
        "chunk size -1": chunked + b"-1\r\n" + smuggled,
        "chunk size of 24 digits": chunked + b"1" * 24 + b"\r\n" + smuggled,
        "chunk extension with a bare LF": chunked + b"5;a\nb\r\nhello\r\n0\r\n\r\n" + smuggled,
        "a trailer hiding a request": chunked + b"0\r\nX-T: a\n\n" + smuggled + b"\r\n\r\n",
        "Transfer-Encoding: xchunked": b"POST /upload HTTP/1.1\r\n" + h + b"Transfer-Encoding: xchunked\r\n\r\n" + body,
        "two Transfer-Encoding fields": b"POST /upload HTTP/1.1\r\n"
        + h
        + b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n"
        + body,
        "chunked, identity": b"POST /upload HTTP/1.1\r\n" + h + b"Transfer-Encoding: chunked, identity\r\n\r\n" + body,
        "CL.TE": b"POST /upload HTTP/1.1\r\n"
        + h
        + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body)
        + body,
        "two different Content-Lengths": b"POST /upload HTTP/1.1\r\n"
        + h
        + b"Content-Length: 5\r\nContent-Length: %d\r\n\r\nhello" % (5 + len(smuggled))
        + smuggled,
        "a malformed chunk terminator": chunked + b"5\r\nhelloXX0\r\n\r\n",
        "two Host fields": b"GET /a HTTP/1.1\r\n" + h + b"Host: other.localhost\r\n\r\n",
        "a target with a LF": b"GET /a\nb HTTP/1.1\r\n" + h + b"\r\n",
        "a target with a NUL": b"GET /a\x00b HTTP/1.1\r\n" + h + b"\r\n",
        "a target with a TAB": b"GET /a\tb HTTP/1.1\r\n" + h + b"\r\n",
        "obs-fold": b"GET /a HTTP/1.1\r\n" + h + b"X-A: a\r\n b\r\n\r\n",
        "a space before the colon": b"GET /a HTTP/1.1\r\n" + h + b"X-A : a\r\n\r\n",
    }
