"""The edge's side of the backhaul: a machine on another host is reached through its worker.

A machine listens on its host's loopback only (never on the network), so the edge reaches a machine on its own
host directly (its loopback port, no extra hop) and any other through that host's worker: a connection to the
worker's advertised address and backhaul port (its heartbeat says both), one preamble line naming the machine
and its port, the worker's `ok` (`bus.contract.backhaul`, `workers.agent.backhaul`), then the request's bytes.
Such a connection is pooled per machine like a direct one, so the preamble is paid once per connection, not
per request. On a secure fleet it is mutual TLS with the fleet's CA, and the worker's certificate must be the
one issued to the machine's worker (`worker-<id>`).

A host that does not answer is noticed as fast as a dead machine: the connect and the preamble's answer are
bounded (`CONNECT_TIMEOUT`), and the host is then suspect for `SUSPECT_FOR`: every dial to it fails at once,
so the request and the next ones go to the app's other machines (`failover` avoids each machine that failed).
A connection already open to a host that froze or was cut cannot tell: while connections to a host are in
use, the dialer asks the host every `PROBE_EVERY` (a `ping` preamble, answered by the worker itself), and a
probe that gets no answer in `CONNECT_TIMEOUT` makes the host suspect and cuts those connections, so their
requests fail over (a safe request is sent again elsewhere) instead of waiting for the response timeout.
After `SUSPECT_FOR` the next dial tries the host again: a host that answers is used again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from bus.contract.backhaul import MAX_LINE, OK, ping_line, request_line
from bus.contract.fleet import WorkerInfo
from bus.contract.machines import MachineIndexEntry
from bus.transport.addresses import is_loopback
from bus.transport.credentials import peer_name
from orchestrator.proxy.upstream import LOOPBACK, Address, Conn, HostUnreachable

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 0.75  # seconds for a backhaul's connect (and TLS handshake), and again for its answer
SUSPECT_FOR = 2.0  # seconds a host that did not answer is not dialed
PROBE_EVERY = 0.5  # seconds between probes of a host while connections to it are in use
Host = tuple[str, int]  # a backhaul: (address, port)


class Dialer:
    def __init__(
        self,
        worker: Callable[[str, str], WorkerInfo | None],
        *,
        local: AbstractSet[str] = frozenset(),
        always: bool = False,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        suspect_for: float = SUSPECT_FOR,
        probe_every: float = PROBE_EVERY,
        on_suspect: Callable[[Host], None] = lambda host: None,
    ) -> None:
        self.worker = worker  # (region, worker id) -> its heartbeat, from the route table's registry
        self.local = frozenset(local)  # this host's addresses: a machine there is dialed on loopback
        self.always = always  # through the backhaul even on this host (`fauxmad proxy --backhaul always`)
        self.tls = tls
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.connect_timeout = connect_timeout
        self.suspect_for = suspect_for
        self.probe_every = probe_every
        self.on_suspect = on_suspect  # a host just found unreachable (the pool drops its kept connections)
        self.suspects: dict[Host, float] = {}  # backhaul -> until when it is not dialed
        self._busy: dict[Host, set[Conn]] = {}  # connections in use per backhaul
        self._probes: dict[Host, asyncio.Task[None]] = {}

    def address(self, entry: MachineIndexEntry, port: int) -> Address:
        """Where the machine answers: loopback when its worker is on this host (or says no address: an older
        worker, or a one-host fleet), else its worker's backhaul."""
        info = self.worker(entry.region, entry.worker_id)
        host = (info.address if info is not None and info.address else entry.address) or LOOPBACK
        if info is None or not info.backhaul or (not self.always and (host in self.local or host == LOOPBACK)):
            return Address(LOOPBACK if host in self.local or is_loopback(host) else host, port)
        return Address(host, port, info.backhaul, entry.id, entry.worker_id)

    def suspected(self, host: Host) -> bool:
        until = self.suspects.get(host)
        if until is None:
            return False
        if until <= self.clock():
            del self.suspects[host]
            return False
        return True

    def check(self, address: Address) -> None:
        """`HostUnreachable` at once for a host found unreachable a moment ago."""
        if self.suspects and self.suspected((address.host, address.via)):
            raise HostUnreachable(f"host {address.host} did not answer lately (suspect for {self.suspect_for:g}s)")

    def suspect(self, host: Host, why: str) -> None:
        """The host did not answer: dial it no more for a while, cut what is open to it."""
        first = not self.suspected(host)
        self.suspects[host] = self.clock() + self.suspect_for
        if first:
            log.warning("proxy: host %s (backhaul port %s) is suspect for %gs: %s", *host, self.suspect_for, why)
        for conn in list(self._busy.pop(host, ())):
            with contextlib.suppress(Exception):
                conn.writer.transport.abort()
        self.on_suspect(host)

    async def open(self, address: Address) -> Conn:
        """A connection to the machine through its worker's backhaul, its preamble answered `ok`. Raises
        `HostUnreachable` when the host does not answer in time, ConnectionRefusedError when the worker
        refuses (the machine is not its own, or refuses the connection: as a refused direct connect)."""
        self.check(address)
        host = (address.host, address.via)
        reader, writer = await self._connect(host)
        answer = await self._ask(host, reader, writer, request_line(address.machine, address.port), address.worker)
        if answer != OK:
            with contextlib.suppress(Exception):
                writer.close()
            text = answer.decode("ascii", "replace").strip() or "closed without an answer"
            raise ConnectionRefusedError(f"backhaul of {address.host}: {text}")
        conn = Conn(address, reader, writer)
        self.in_use(conn)
        return conn

    async def _connect(self, host: Host) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.wait_for(
                asyncio.open_connection(
                    *host, limit=64 * 1024, ssl=self.tls, server_hostname=host[0] if self.tls else None
                ),
                self.connect_timeout,
            )
        except TimeoutError:
            why = f"no connection within {self.connect_timeout:g}s"
        except ssl.SSLError as exc:
            raise ConnectionRefusedError(f"backhaul of {host[0]}: TLS: {exc.reason or exc}") from None
        except OSError as exc:
            why = exc.strerror or str(exc)
        self.suspect(host, why)
        raise HostUnreachable(f"host {host[0]} is unreachable: {why}")

    async def _ask(
        self, host: Host, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: bytes, worker: str
    ) -> bytes:
        """Send a preamble, read the answer line (b'' when the worker closed); a host that does not answer in
        time is suspect (`HostUnreachable`)."""
        if self.tls is not None and worker:
            name = peer_name(writer.get_extra_info("peercert"))
            if name != f"worker-{worker}":
                writer.close()
                raise ConnectionRefusedError(f"backhaul of {host[0]}: certificate of {name!r}, not worker-{worker}")
        writer.write(line)
        try:
            answer = await asyncio.wait_for(reader.readuntil(b"\n"), self.connect_timeout)
        except TimeoutError:
            writer.close()
            self.suspect(host, f"no answer within {self.connect_timeout:g}s")
            raise HostUnreachable(f"host {host[0]} did not answer within {self.connect_timeout:g}s") from None
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            return b""
        return answer[:MAX_LINE]

    # -- connections in use, and the probes that watch their hosts -------------------------------------------
    def in_use(self, conn: Conn) -> None:
        """A backhaul connection carries a request: its host is probed until it is back in the pool."""
        host = (conn.address.host, conn.address.via)
        self._busy.setdefault(host, set()).add(conn)
        conn.on_close = self._closed
        if host not in self._probes:
            self._probes[host] = asyncio.ensure_future(self._probe(host))

    def idle(self, conn: Conn) -> None:
        busy = self._busy.get((conn.address.host, conn.address.via))
        if busy is not None:
            busy.discard(conn)

    def _closed(self, conn: Conn) -> None:
        self.idle(conn)
        conn.on_close = None

    async def _probe(self, host: Host) -> None:
        """While connections to `host` are in use, ask it every `probe_every` whether it is there."""
        try:
            while self._busy.get(host):
                await asyncio.sleep(self.probe_every)
                if not self._busy.get(host) or self.suspected(host):
                    continue
                try:
                    reader, writer = await self._connect(host)
                except ConnectionRefusedError:
                    continue  # TLS refused: a host that answers
                except HostUnreachable:
                    continue  # suspect now, and what was open to it cut
                try:
                    await self._ask(host, reader, writer, ping_line(), "")
                except HostUnreachable:
                    pass
                finally:
                    writer.close()
        finally:
            self._probes.pop(host, None)

    def close(self) -> None:
        for task in self._probes.values():
            task.cancel()
