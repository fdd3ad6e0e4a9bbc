"""A small HTTP/1.1 app for the edge proxy's tests and benchmark: standard library only (uvloop if present).

Listens on $PORT with keep-alive. `GET /` answers JSON naming the machine and the request's headers;
`/slow?ms=N` answers after N ms (to hold a slot); `POST /echo` streams the body back as it arrives,
chunked; `/stream?chunks=N&ms=M` sends N chunks M ms apart; `/ws` is a WebSocket echo (RFC 6455 frames).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from urllib.parse import parse_qs, urlsplit

MACHINE = os.environ.get("FAUXMAD_MACHINE_ID", "local")
REGION = os.environ.get("FAUXMAD_REGION", "")
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def respond(writer: asyncio.StreamWriter, status: str, body: bytes, kind: str = "application/json") -> None:
    writer.write(
        f"HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {len(body)}\r\n"
        f"x-machine: {MACHINE}\r\n\r\n".encode()
        + body
    )


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]):  # type: ignore[no-untyped-def]
    """Yield the request body's pieces as they arrive (Content-Length or chunked)."""
    if headers.get("transfer-encoding", "").lower().endswith("chunked"):
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    left = int(headers.get("content-length", "0"))
    while left:
        piece = await reader.read(min(left, 65536))
        if not piece:
            return
        left -= len(piece)
        yield piece


async def websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: str) -> None:
    accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
    writer.write(
        "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        f"sec-websocket-accept: {accept}\r\n\r\n".encode()
    )
    while True:
        first, second = await reader.readexactly(2)
        opcode, length = first & 0x0F, second & 0x7F
        if length == 126:
            length = int.from_bytes(await reader.readexactly(2), "big")
        elif length == 127:
            length = int.from_bytes(await reader.readexactly(8), "big")
        mask = await reader.readexactly(4) if second & 0x80 else b"\0\0\0\0"
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(await reader.readexactly(length)))
        if opcode == 8:  # close: answer it and end
            writer.write(bytes([0x88, len(payload[:125])]) + payload[:125])
            await writer.drain()
            return
        header = bytes([0x80 | opcode])
        if len(payload) < 126:
            header += bytes([len(payload)])
        else:
            header += bytes([126]) + len(payload).to_bytes(2, "big")
        writer.write(header + payload)
        await writer.drain()


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    target = lines[0].split(" ", 2)[1]
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return target, headers


async def chunked(writer: asyncio.StreamWriter, pieces) -> None:  # type: ignore[no-untyped-def]
    writer.write(f"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-machine: {MACHINE}\r\n\r\n".encode())
    async for piece in pieces:
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await writer.drain()
    writer.write(b"0\r\n\r\n")


async def ticks(count: int, ms: float):  # type: ignore[no-untyped-def]
    for i in range(count):
        yield f"chunk {i}\n".encode()
        await asyncio.sleep(ms / 1000)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            target, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
            url = urlsplit(target)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            if url.path == "/ws" and headers.get("upgrade", "").lower() == "websocket":
                await websocket(reader, writer, headers.get("sec-websocket-key", ""))
                return
            if url.path == "/echo":
                await chunked(writer, read_body(reader, headers))
            elif url.path == "/stream":
                await chunked(writer, ticks(int(query.get("chunks", "3")), float(query.get("ms", "10"))))
            else:
                async for _ in read_body(reader, headers):
                    pass
                if url.path == "/slow":
                    await asyncio.sleep(float(query.get("ms", "100")) / 1000)
                seen = {"machine": MACHINE, "region": REGION, "pid": os.getpid(), "path": url.path}
                body = json.dumps({**seen, "headers": headers})
                respond(writer, "200 OK", body.encode())
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                return
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", int(os.environ.get("PORT", "8000")), backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
