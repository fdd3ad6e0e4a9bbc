"""Connections to machines: opened on demand, kept alive between requests, reused per machine.

A kept connection may have been closed by the machine meanwhile (its idle timeout, a restart); the
caller learns that when the response head does not come, and retries on a fresh connection only when
the request is safe to send twice. Waiting for a machine just started to accept connections is here too:
a process may take a few milliseconds to bind after the worker says `started`.

An `Address` is where a machine answers: its port on this host's loopback (a machine on the edge's own host,
dialed directly), or its worker's backhaul on another host (`via`), which the `Dialer` (`backhaul`) opens and
asks for the machine. Kept connections are pooled per address either way, so a backhaul connection, once
its preamble is answered, carries request after request like a direct one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import NamedTuple, Protocol

from bus.contract.machines import MachineIndexEntry

MAX_IDLE_PER_MACHINE = 64
LOOPBACK = "127.0.0.1"  # local: a machine on the edge's own host is dialed on its loopback (`backhaul.Dialer`)


class HostUnreachable(ConnectionError):
    """A machine's host did not answer through its backhaul (or was found so a moment ago): no use waiting."""


class Address(NamedTuple):
    """Where a machine answers: `host:port` directly, or, with `via`, the backhaul at `host:via` of the worker
    `worker`, asked for `machine`'s `port`."""

    host: str
    port: int
    via: int = 0
    machine: str = ""
    worker: str = ""


class Conn:
    __slots__ = ("address", "on_close", "reader", "reused", "writer")

    def __init__(self, address: Address, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.address = address
        self.reader = reader
        self.writer = writer
        self.reused = False
        self.on_close: Callable[[Conn], None] | None = None  # the dialer's, for a backhaul connection in use

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close(self)
        with contextlib.suppress(Exception):
            self.writer.close()

    def closed(self) -> bool:
        """Closed by the machine (end of file read) or by us."""
        return self.reader.at_eof() or self.writer.is_closing()


class Dialer(Protocol):
    """What the pool asks of the backhaul's dialer (`backhaul.Dialer`), said here so this module needs nothing of it."""

    def address(self, entry: MachineIndexEntry, port: int) -> Address: ...
    def check(self, address: Address) -> None: ...
    async def open(self, address: Address) -> Conn: ...
    def in_use(self, conn: Conn) -> None: ...
    def idle(self, conn: Conn) -> None: ...


class Pool:
    def __init__(self, dialer: Dialer | None = None, *, machine_host: str | None = None) -> None:
        self._idle: dict[Address, list[Conn]] = {}
        self.dialer = dialer  # None: every machine on this host (its loopback), as `fauxmad dev` has it
        self.machine_host = machine_host  # `--machine-host`: every machine dialed there, whatever its address

    def address(self, entry: MachineIndexEntry, port: int) -> Address:
        """Where the machine answers on `port` (`Dialer.address`), or at the one host all are reached at."""
        if self.machine_host is not None or self.dialer is None:
            return Address(self.machine_host or LOOPBACK, port)
        return self.dialer.address(entry, port)

    async def open(self, address: Address) -> Conn:
        """A new connection to `address` (OSError when it is refused or its host is unreachable)."""
        if address.via and self.dialer is not None:
            return await self.dialer.open(address)
        reader, writer = await asyncio.open_connection(address.host, address.port, limit=64 * 1024)
        return Conn(address, reader, writer)

    async def get(self, address: Address, *, fresh: bool = False) -> Conn:
        if address.via and self.dialer is not None:
            self.dialer.check(address)  # a host found unreachable: at once, not after a kept connection's wait
        idle = self._idle.get(address)
        while idle and not fresh:
            conn = idle.pop()
            if conn.closed():
                conn.close()
                continue
            conn.reused = True
            if address.via and self.dialer is not None:
                self.dialer.in_use(conn)
            return conn
        return await self.open(address)

    def has_idle(self, address: Address) -> bool:
        """Whether a kept connection to `address` is open (those the machine closed meanwhile are dropped)."""
        idle = self._idle.get(address)
        while idle and idle[-1].closed():
            idle.pop().close()
        return bool(idle)

    def put(self, conn: Conn) -> None:
        if conn.on_close is not None and self.dialer is not None:
            self.dialer.idle(conn)
        idle = self._idle.setdefault(conn.address, [])
        if len(idle) >= MAX_IDLE_PER_MACHINE or conn.writer.is_closing():
            conn.close()
            return
        idle.append(conn)

    def drop(self, address: Address) -> None:
        for conn in self._idle.pop(address, []):
            conn.close()

    def drop_host(self, host: str, via: int) -> None:
        """Close the kept connections through one backhaul (its host was found unreachable)."""
        for address in [a for a in self._idle if a.via == via and a.host == host]:
            self.drop(address)

    def close(self) -> None:
        for address in list(self._idle):
            self.drop(address)


MAX_CONNECT_STEP = 0.005  # seconds between connects to a machine that does not listen yet


async def connect_when_up(
    address: Address | tuple[str, int],
    timeout: float,
    *,
    step: float = 0.001,
    clock: Callable[[], float] | None = None,
    pool: Pool | None = None,
) -> Conn | None:
    """A connection to `address` as soon as it accepts one (a process just started binds its port a moment
    after the worker says `started`), or None after `timeout`. A refused connect costs microseconds locally,
    so the step starts short and grows slowly to `MAX_CONNECT_STEP`: a held request learns that the machine
    listens at most that late (a step that doubled to 50 ms added up to 20 ms to a start's first byte)."""
    loop = asyncio.get_running_loop()
    now = clock or loop.time
    deadline = now() + timeout
    opener = pool or Pool()
    where = address if isinstance(address, Address) else Address(*address)
    while True:
        try:
            return await opener.open(where)
        except HostUnreachable:
            return None
        except OSError:
            if now() >= deadline:
                return None
            await asyncio.sleep(step)
            step = min(step * 1.25, MAX_CONNECT_STEP)
