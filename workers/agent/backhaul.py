"""The worker's backhaul: an edge proxy on another host reaches this host's machines through it.

A machine listens on its host's loopback only; it is never exposed on the network (Fly's design: fly-proxy
on every worker host, the edge forwards over the backhaul to it). So the worker, which runs on every worker
host anyway, listens on its advertised address (`--advertise`, port `--backhaul-port`, ephemeral by
default so many workers share a host) and serves one preamble per connection (`bus.contract.backhaul`):
the machine must be this worker's, not destroyed, and the port its own (its `PORT`, or a port its services or
its checks name); anything else is `error <why>` and the connection is closed. Only a port the worker gave
a machine is reachable, never another service on the host's loopback (NATS, the metrics, another fleet).

Then the worker connects to the machine's port on loopback and answers `ok` only once it holds that
connection: a machine that refuses is an error line the edge reads as a refused connection, so the edge's
handling of a dead machine (failover, the late binder) is the same across hosts. After `ok` the bytes are
spliced both ways. On a secure fleet the listener is mutual TLS with the fleet's CA (the worker's
credentials): an edge without a certificate from that CA never reaches the preamble, and one whose certificate
names a role outside `BACKHAUL_ROLES` (a deployer's) is refused in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable

from bus.contract.backhaul import BACKHAUL_ROLES, MAX_LINE, OK, PreambleError, error_line, parse_request
from bus.contract.machines import Machine
from bus.transport.credentials import peer_name, peer_role

log = logging.getLogger(__name__)

PREAMBLE_TIMEOUT = 5.0  # seconds an edge has to send its preamble once connected (or finish its handshake)
CONNECT_TIMEOUT = 2.0  # seconds for the machine's loopback port to accept
CHUNK = 64 * 1024
LOCAL = "127.0.0.1"  # local: a machine listens on its own host's loopback, and the worker is on that host


def allowed_ports(machine: Machine) -> set[int]:
    """The ports of `machine` an edge may ask for: its `PORT`, its services' and those its checks name."""
    ports = {check.port for check in machine.config.checks.values() if check.port}
    ports.update(service.internal_port for service in machine.config.services)
    if machine.port:
        ports.add(machine.port)
    return ports


class Backhaul:
    def __init__(self, machine: Callable[[str], Machine | None], *, tls: ssl.SSLContext | None = None) -> None:
        self.machine = machine  # a machine of this worker by id (None: not one of its own)
        self.tls = tls
        self.server: asyncio.Server | None = None
        self.port = 0
        self._open: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (0: a free port); the port listened on."""
        self.server = await asyncio.start_server(
            self._serve, host, port, ssl=self.tls, ssl_handshake_timeout=PREAMBLE_TIMEOUT if self.tls else None
        )
        self.port = int(self.server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._open):
            task.cancel()
        await asyncio.gather(*self._open, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        try:
            upstream = await self._accept(reader, writer)
            if upstream is not None:
                await _splice(reader, writer, *upstream)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self._open.discard(task)
            with contextlib.suppress(Exception):
                writer.close()

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Read and check the preamble; the machine's connection once `ok` is sent, or None (an error sent)."""
        try:
            line = await asyncio.wait_for(reader.readuntil(b"\n"), PREAMBLE_TIMEOUT)
            if len(line) > MAX_LINE:
                raise PreambleError(f"the preamble is over {MAX_LINE} bytes")
            asked = parse_request(line)
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError):
            return None
        except PreambleError as exc:
            await _refuse(writer, str(exc))
            return None
        if asked is None:  # a ping: this host and its worker answer
            writer.write(OK)
            await asyncio.wait_for(writer.drain(), PREAMBLE_TIMEOUT)
            return None
        refusal = self._refusal_of_peer(writer)
        if refusal:
            await _refuse(writer, refusal)
            return None
        machine_id, port = asked
        machine = self.machine(machine_id)
        if machine is None or machine.state == "destroyed":
            await _refuse(writer, f"machine {machine_id} is not on this worker")
            return None
        if port not in allowed_ports(machine):
            await _refuse(writer, f"machine {machine_id} has no port {port}")
            return None
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(LOCAL, port, limit=CHUNK), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            await _refuse(writer, f"machine {machine_id} refused the connection on port {port}: {why}")
            return None
        writer.write(OK)
        return upstream

    def _refusal_of_peer(self, writer: asyncio.StreamWriter) -> str:
        """Why the peer may not open a machine's connection ('' when it may): on a secure fleet, a certificate
        of a role in `BACKHAUL_ROLES` (the CA's other certificates, a deployer's among them, are refused)."""
        if self.tls is None:
            return ""
        peercert = writer.get_extra_info("peercert")
        role = peer_role(peercert)
        if role in BACKHAUL_ROLES:
            return ""
        name = peer_name(peercert) or "?"
        if not role:
            return f"the certificate of {name} names no role: renew it with `fauxmad fleet rotate {name}`"
        return f"{name} has role {role}: only the proxy and operator roles may use the backhaul"


async def _refuse(writer: asyncio.StreamWriter, why: str) -> None:
    writer.write(error_line(why))
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.drain(), 1.0)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            if writer.transport.get_write_buffer_size() > CHUNK:
                await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()


async def _splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Bytes both ways until both directions ended (a half close is passed on), then both closed."""
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    finally:
        with contextlib.suppress(Exception):
            up_writer.close()
