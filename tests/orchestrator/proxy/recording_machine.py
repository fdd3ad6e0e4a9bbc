"""A machine for the edge's smuggling tests: a small HTTP/1.1 server that logs every request it parses.

Run by a worker as a machine (`python recording_machine.py LOG`), it listens on $PORT and reads requests
the lenient way many servers do (a bare LF ends a line, chunked wins over a length, a chunk size is
whatever `int(x, 16)` takes), so a request the proxy lets through hidden in another shows up here as a
request of its own. Each request is written to LOG as one JSON line once its body is read (`POST /early`
at once: it answers before reading its body, then reads and drops the body, as a server may), and is
answered with a JSON body naming its method and target. Standard library only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

LOG = sys.argv[1] if len(sys.argv) > 1 else "/dev/null"


def record(entry: dict[str, object]) -> None:
    with open(LOG, "a", encoding="utf-8") as out:
        out.write(json.dumps(entry) + "\n")


async def line(reader: asyncio.StreamReader) -> str:
    return (await reader.readuntil(b"\n")).decode("latin-1").rstrip("\r\n")


async def body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = b""
        while True:
            size = int((await line(reader)).split(";")[0].strip(), 16)
            if size == 0:
                while await line(reader):
                    pass
                return out
            out += await reader.readexactly(size)
            await line(reader)
    return await reader.readexactly(int(headers.get("content-length", "0") or "0"))


def answer(writer: asyncio.StreamWriter, entry: dict[str, object]) -> None:
    data = json.dumps({"method": entry["method"], "target": entry["target"]}).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)
    )


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            request_line = await line(reader)
            if not request_line:
                continue
            method, target, _ = [*request_line.split(" ", 2), "", ""][:3]
            fields: list[list[str]] = []
            while header := await line(reader):
                name, _, value = header.partition(":")
                fields.append([name.strip().lower(), value.strip()])
            headers = {name: value for name, value in fields}
            entry: dict[str, object] = {"method": method, "target": target, "fields": fields}
            if target == "/early":  # answered before its body is read; the body read and dropped after
                record(entry)
                answer(writer, entry)
                await writer.drain()
                await body(reader, headers)
                continue
            entry["body"] = (await body(reader, headers)).decode("latin-1")
            record(entry)
            answer(writer, entry)
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", int(os.environ.get("PORT", "8000")))
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
