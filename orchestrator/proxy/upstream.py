"""Connections to machines: opened on demand, kept alive between requests, reused per machine.

A kept connection may have been closed by the machine meanwhile (its idle timeout, a restart); the
caller learns that when the response head does not come, and retries on a fresh connection only when
the request is safe to send twice. Waiting for a machine just started to accept connections is here too:
a process may take a few milliseconds to bind after the worker says `started`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

MAX_IDLE_PER_MACHINE = 64

Address = tuple[str, int]


class Conn:
    __slots__ = ("address", "reader", "reused", "writer")

    def __init__(self, address: Address, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    def closed(self) -> bool:
        """Closed by the machine (end of file read) or by us."""
        return self.reader.at_eof() or self.writer.is_closing()


class Pool:
    def __init__(self) -> None:
        self._idle: dict[Address, list[Conn]] = {}

    async def get(self, address: Address, *, fresh: bool = False) -> Conn:
        idle = self._idle.get(address)
        while idle and not fresh:
            conn = idle.pop()
            if conn.closed():
                conn.close()
                continue
            conn.reused = True
            return conn
        reader, writer = await asyncio.open_connection(*address, limit=64 * 1024)
        return Conn(address, reader, writer)

    def has_idle(self, address: Address) -> bool:
        """Whether a kept connection to `address` is open (those the machine closed meanwhile are dropped)."""
        idle = self._idle.get(address)
        while idle and idle[-1].closed():
            idle.pop().close()
        return bool(idle)

    def put(self, conn: Conn) -> None:
        idle = self._idle.setdefault(conn.address, [])
        if len(idle) >= MAX_IDLE_PER_MACHINE or conn.writer.is_closing():
            conn.close()
            return
        idle.append(conn)

    def drop(self, address: Address) -> None:
        for conn in self._idle.pop(address, []):
            conn.close()

    def close(self) -> None:
        for address in list(self._idle):
            self.drop(address)


MAX_CONNECT_STEP = 0.005  # seconds between connects to a machine that does not listen yet


async def connect_when_up(
    address: Address, timeout: float, *, step: float = 0.001, clock: Callable[[], float] | None = None
) -> Conn | None:
    """A connection to `address` as soon as it accepts one (a process just started binds its port a moment
    after the worker says `started`), or None after `timeout`. A refused connect costs microseconds locally,
    so the step starts short and grows slowly to `MAX_CONNECT_STEP`: a held request learns that the machine
    listens at most that late (a step that doubled to 50 ms added up to 20 ms to a start's first byte)."""
    loop = asyncio.get_running_loop()
    now = clock or loop.time
    deadline = now() + timeout
    while True:
        try:
            reader, writer = await asyncio.open_connection(*address, limit=64 * 1024)
        except OSError:
            if now() >= deadline:
                return None
            await asyncio.sleep(step)
            step = min(step * 1.25, MAX_CONNECT_STEP)
            continue
        return Conn(address, reader, writer)
