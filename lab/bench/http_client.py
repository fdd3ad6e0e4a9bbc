"""A raw HTTP/1.1 client over asyncio streams (no library): keep-alive, exactly the bytes a server sent.

The proxy benchmark and the proxy's tests use it, so what they measure is the proxy and the machine,
not a client library's own framing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec


class Response(msgspec.Struct):
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


async def read_response(reader: asyncio.StreamReader, method: str = "GET") -> Response:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = b""
    if method == "HEAD" or status in (204, 304) or status < 200:
        pass
    elif headers.get("transfer-encoding", "").endswith("chunked"):
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    else:
        body = await reader.read()
    return Response(status=status, headers=headers, body=body)


class Client:
    """One keep-alive connection to the proxy."""

    def __init__(self, port: int, address: str = "127.0.0.1") -> None:
        self.port = port
        self.address = address  # a proxy on another host (`fauxmad dev --hosts`): its own address
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self,
        host: str,
        path: str = "/",
        *,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        body: bytes = b"",
    ) -> Response:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.address, self.port)
        assert self.reader is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        length = f"content-length: {len(body)}\r\n" if body else ""
        self.writer.write(f"{method} {path} HTTP/1.1\r\nhost: {host}\r\n{extra}{length}\r\n".encode() + body)
        response = await read_response(self.reader, method)
        if response.headers.get("connection") == "close":
            self.writer.close()
            self.writer = None
        return response

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
