"""One client connection at a time: read a request, choose a machine, forward it, relay the answer.

Everything the proxy refuses is answered here, by the proxy, in one line of text and then the connection
is closed: 400 (no or bad Host, malformed head), 404 (no such app), 408 (a head that does not arrive in
time: slowloris), 431 (a head too big), 502 (no machine could take it, and why), 503 (every machine at
its hard limit through the bounded wait; Retry-After), 504 (the machine did not answer in time). An
exception from a handler becomes a 502 if nothing was sent yet, else the connection is cut: never a
traceback to a client and never a connection left hanging.

Failover: a machine that refuses a connection (or drops one before any response byte) is avoided for a
few seconds by this proxy, the request goes to another when nothing was sent upstream yet (or when it
is idempotent and has no body: it can be sent again), and the failure is published on
`fauxmad.v1.proxy.unreachable.<app>.<machine>` for the reconcilers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.messages import ProxyUnreachable
from orchestrator.proxy.choose import Candidate, Create, NoMachine, Policy, Route, Start, Wait, choose, region_order
from orchestrator.proxy.deadlines import Deadlines, Watch
from orchestrator.proxy.http import (
    CHUNK,
    HOP_BY_HOP,
    MAX_HEAD,
    Framing,
    Head,
    HttpError,
    body_framing,
    error_response,
    parse_request_head,
    parse_response_head,
    relay_body,
    response_has_body,
    split_host,
)
from orchestrator.proxy.metrics import ProxyMetrics
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Conn, Pool, connect_when_up
from orchestrator.proxy.wake import WakeError, Waker

log = logging.getLogger(__name__)

IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
# sent ahead of a resume (`Proxy._resume_ahead`): a request a frozen machine may still read much later must
# change nothing; an idempotent PUT or DELETE read after newer writes would undo them
AHEAD = frozenset({b"GET", b"HEAD", b"OPTIONS"})
ATTEMPTS = 4


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    region: str
    domain: str = "localhost"
    machine_host: str = "127.0.0.1"  # where machines' ports are reached (fauxmad dev: one host)
    latency: dict[str, float] = {}  # region -> milliseconds from this proxy's region
    head_timeout: float = 10.0  # a request head must arrive whole within this (slowloris)
    keepalive_timeout: float = 75.0  # an idle client connection is closed after this
    response_timeout: float = 60.0  # for the machine's response head
    queue_timeout: float = 5.0  # how long a request waits for a slot when every machine is at its hard limit
    max_queue: int = 1024  # requests waiting per app; more are a 503 at once
    ready_timeout: float = 10.0  # a machine started for a request must accept connections within this
    avoid_for: float = 5.0  # seconds a machine that refused a connection is avoided


class Refused(Exception):
    """The proxy answers this request itself: status, one line, maybe Retry-After."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class _Upstream(Exception):
    """The machine failed before its response began; `resend`: sending the request again is safe."""

    def __init__(self, why: str, *, resend: bool) -> None:
        super().__init__(why)
        self.resend = resend


class _ResumeFailed(Exception):
    """The resume a request was sent ahead of failed: the machine never read it; the reason."""


class Exchange:
    """One request as it goes: what the handler needs to finish it and to account for it."""

    __slots__ = (
        "app",
        "client_keep",
        "framing",
        "head",
        "machine",
        "region",
        "request_id",
        "responded",
        "safe",
        "status",
        "waking",
        "watch",
    )

    def __init__(self, head: Head, request_id: str, watch: Watch) -> None:
        self.head = head
        self.watch = watch  # the connection's deadline (the response head's wait)
        self.request_id = request_id
        self.app = ""
        self.machine: str | None = None
        self.region = ""
        self.status = 0
        self.responded = False  # a byte of the response went to the client
        self.client_keep = False
        self.framing = Framing(False, 0)
        self.safe = False  # idempotent and without a body: it may be sent twice
        self.waking: asyncio.Future[Any] | None = None  # the resume this request was sent ahead of


class Proxy:
    def __init__(
        self,
        config: ProxyConfig,
        routes: RouteTable,
        waker: Waker | None,
        *,
        pool: Pool | None = None,
        metrics: ProxyMetrics | None = None,
        publish: Callable[[str, bytes], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.routes = routes
        self.waker = waker
        self.pool = pool or Pool()
        self.metrics = metrics or ProxyMetrics()
        self.publish = publish
        self.clock = clock
        self.rng = rng or random.Random()
        self.loads: dict[str, int] = {}
        self.last_used: dict[str, float] = {}
        self._bad: dict[str, float] = {}
        self._freed: dict[str, asyncio.Event] = {}
        self._queued: dict[str, int] = {}
        self._orders: dict[tuple[frozenset[str], str | None], list[str]] = {}
        self._policies: dict[str, tuple[App, Policy]] = {}
        self.deadlines = Deadlines(clock)

    # ------------------------------------------------------------------------------------------
    # the connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client_ip = peer[0] if isinstance(peer, tuple) else ""
        held: list[str] = []  # concurrency type `connections`: the machine this connection holds
        watch = self.deadlines.watch()
        try:
            first = True
            while True:
                timeout = self.config.head_timeout if first else self.config.keepalive_timeout
                data = await self._read_head(reader, writer, timeout, first, watch)
                if data is None:
                    return
                first = False
                if not await self._one(data, reader, writer, client_ip, held, watch):
                    return
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.deadlines.forget(watch)
            for machine_id in held:
                self._release(machine_id)
            with contextlib.suppress(Exception):
                writer.close()

    async def _read_head(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float, first: bool, watch: Watch
    ) -> bytes | None:
        watch.arm(timeout)  # no timer per read (asyncio.timeout's): this is the hot path
        try:
            return await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            writer.write(error_response(431, f"request head over {MAX_HEAD} bytes", _request_id()))
        except asyncio.CancelledError:
            if not watch.expired():
                raise
            if not first:  # an idle keep-alive connection: just close it
                return None
            writer.write(error_response(408, "the request head did not arrive in time", _request_id()))
        finally:
            watch.disarm()
        with contextlib.suppress(Exception):
            await writer.drain()
        return None

    async def _one(
        self,
        data: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_ip: str,
        held: list[str],
        watch: Watch,
    ) -> bool:
        """Serve one request; True when the client connection stays open for the next."""
        began = self.clock()
        request_id = _request_id()
        ex: Exchange | None = None
        try:
            head = parse_request_head(data)
            ex = Exchange(head, request_id, watch)
            await self._serve(ex, reader, writer, client_ip, held)
            return ex.client_keep
        except (HttpError, Refused) as exc:
            status = exc.status
            message = exc.reason if isinstance(exc, HttpError) else exc.message
            retry = exc.retry_after if isinstance(exc, Refused) else None
            if ex is not None:
                ex.status = status
            if ex is None or not ex.responded:
                writer.write(error_response(status, message, request_id, retry_after=retry))
                with contextlib.suppress(Exception):
                    await writer.drain()
            return False
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            if ex is not None and not ex.responded:
                ex.status = 502
                app = ex.app or "the app"
                writer.write(error_response(502, f"no machine of {app} could take this request ({exc})", request_id))
            return False
        except Exception:
            log.exception("proxy: request %s failed", request_id)
            if ex is not None and not ex.responded:
                ex.status = 502
                writer.write(error_response(502, "the proxy failed to forward this request", request_id))
            return False
        finally:
            if ex is not None and ex.app:
                self.metrics.observe(ex.app, ex.region, ex.status, self.clock() - began)

    async def _serve(
        self, ex: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client_ip: str, held: list[str]
    ) -> None:
        head = ex.head
        host = head.get(b"host")
        if host is None:
            raise HttpError(400, "a Host header is required")
        name = split_host(host, self.config.domain)
        if name is None:
            raise HttpError(
                404 if b"." in host else 400, f"no app is served at this host (use <app>.{self.config.domain})"
            )
        app = self.routes.app(name)
        if app is None:
            raise Refused(404, f"unknown app {name}")
        ex.app = name
        ex.framing = body_framing(head, request=True)
        connection = head.tokens(b"connection")
        ex.client_keep = b"close" not in connection if head.version == b"HTTP/1.1" else b"keep-alive" in connection
        upgrade = b"upgrade" in connection and head.get(b"upgrade") is not None
        prefer = head.get(b"fauxmad-prefer-region")
        sticky = app.service.concurrency.type == "connections"
        if sticky and held and self._routable(app.name, held[0]) is None:
            self._release(held.pop())
        ex.safe = safe = head.first in IDEMPOTENT and not ex.framing.chunked and ex.framing.length == 0
        avoid: set[str] = set()
        deadline = self.clock() + self.config.queue_timeout
        for attempt in range(ATTEMPTS):
            ex.waking = None  # a failed attempt's resume is not this one's
            if sticky and held:
                machine_id = held[0]
            else:
                machine_id = await self._pick(
                    app, prefer.decode("ascii", "replace") if prefer else None, avoid, deadline, ex
                )
                self.loads[machine_id] = self.loads.get(machine_id, 0) + 1
                if sticky:
                    held.append(machine_id)
            try:
                await self._forward(ex, app, machine_id, reader, writer, client_ip, upgrade, fresh=attempt > 0)
                return
            except (_Upstream, _ResumeFailed) as failure:
                avoid.add(machine_id)
                if sticky and held:
                    held.pop()
                    self._release(machine_id)
                if not self._may_retry(app, machine_id, failure, safe) or attempt == ATTEMPTS - 1:
                    raise Refused(502, f"no machine of {app.name} could take this request ({failure})") from None
            finally:
                if not sticky:
                    self._release(machine_id)

    def _may_retry(self, app: App, machine_id: str, failure: _Upstream | _ResumeFailed, safe: bool) -> bool:
        """Account for a machine that failed a request; whether the request may go to another."""
        if isinstance(failure, _ResumeFailed):  # as a resume that failed before the request went
            log.warning("proxy: %s", failure)
            return True
        self._failed(app, machine_id, str(failure))
        return failure.resend or safe

    # ------------------------------------------------------------------------------------------
    # choosing

    def _routable(self, app: str, machine_id: str) -> Any:
        entry = self.routes.entry(machine_id)
        if entry is None or entry.app != app or entry.state != "started" or machine_id in self._bad:
            return None
        return entry

    def _candidates(self, app: App) -> list[Candidate]:
        starting = self.waker.starting if self.waker is not None else {}
        loads = self.loads
        return [
            Candidate(m.id, m.region, "started" if m.id in starting else m.state, loads.get(m.id, 0))
            for m in self.routes.machines(app.name)
        ]

    def _avoided(self) -> set[str]:
        if not self._bad:
            return _NONE
        now = self.clock()
        for machine_id, until in list(self._bad.items()):
            if until <= now:
                del self._bad[machine_id]
        return set(self._bad)

    def _policy(self, app: App) -> Policy:
        """The app's choice policy, made once per release the route table holds (`App` is replaced on change)."""
        held = self._policies.get(app.name)
        if held is not None and held[0] is app:
            return held[1]
        service = app.service
        can_wake = self.waker is not None
        policy = Policy(
            soft_limit=service.concurrency.soft_limit,
            hard_limit=service.concurrency.hard_limit,
            auto_start=service.auto_start and can_wake,
            auto_create=service.auto_create and can_wake and app.spec is not None,
            max_per_region=app.region_range("").most,  # a region the release does not name
            most_in={region: app.region_range(region).most for region in (app.spec.regions if app.spec else ())},
        )
        self._policies[app.name] = (app, policy)
        return policy

    async def _pick(self, app: App, prefer: str | None, avoid: set[str], deadline: float, ex: Exchange) -> str:
        policy = self._policy(app)
        while True:
            candidates = self._candidates(app)
            regions = {c.region for c in candidates}
            if policy.auto_create:
                regions.update(self.routes.regions())
            order = self._region_order(regions, prefer)
            bad = self._avoided()
            decision = choose(candidates, policy, order, self.rng, avoid | bad if bad else avoid)
            match decision:
                case Route(machine_id):
                    if await self._started(machine_id):
                        return machine_id
                    avoid.add(machine_id)
                case Start(machine_id):
                    if await self._woken(app, machine_id, ex):
                        return machine_id
                    avoid.add(machine_id)
                case Create(region):
                    assert self.waker is not None
                    try:
                        return (await self.waker.create(app, region)).id
                    except WakeError as exc:
                        raise Refused(502, f"no machine of {app.name} could take this request ({exc})") from None
                case Wait():
                    await self._wait_for_slot(app.name, deadline)
                case NoMachine(why):
                    late = await self._late_binder(app, avoid)
                    if late is None:
                        raise Refused(502, f"no machine of {app.name} could take this request ({why})")
                    return late

    async def _woken(self, app: App, machine_id: str, ex: Exchange) -> bool:
        """Start or resume a machine for this request; False if that failed (logged)."""
        assert self.waker is not None
        if ex.safe and ex.head.first in AHEAD and (waking := self._resume_ahead(app, machine_id)) is not None:
            ex.waking = waking
            return True
        try:
            await self.waker.start(app.name, machine_id)
        except WakeError as exc:
            log.warning("proxy: %s", exc)
            return False
        return True

    def _resume_ahead(self, app: App, machine_id: str) -> asyncio.Future[Any] | None:
        """Resume a suspended machine while its request is already on the way (None: not this way).

        A frozen process's sockets still queue what is written to them: the request goes on a connection
        kept from before the machine was frozen as soon as the resume is asked for, and the machine reads
        it the moment it continues. The first byte then waits for the resume's signal, not for its answer
        to travel back and a request to travel after it (two legs through NATS to a core gone idle: about a
        millisecond). Only for a request that changes nothing (`AHEAD`): if the resume fails, the connection
        is closed and the request goes elsewhere, and a machine continued later may still read it once."""
        assert self.waker is not None
        entry = self.routes.entry(machine_id)
        if entry is None or entry.state not in ("suspended", "suspending") or machine_id in self.waker.starting:
            return None
        if not self.pool.has_idle((self.config.machine_host, self._port(app, entry))):
            return None  # no connection open from before it was frozen: its resume must show it listens first
        waking = self.waker.begin(app.name, machine_id, ahead=True)
        waking.add_done_callback(_mark_retrieved)
        return waking

    def _region_order(self, regions: set[str], prefer: str | None) -> list[str]:
        """`region_order`, remembered: the same few region sets come up on every request."""
        key = (frozenset(regions), prefer)
        order = self._orders.get(key)
        if order is None:
            if len(self._orders) > 1024:
                self._orders.clear()
            order = self._orders[key] = region_order(regions, self.config.region, prefer, self.config.latency)
        return order

    async def _started(self, machine_id: str) -> bool:
        """Wait for this proxy's start of the machine, if one is in flight; False if it failed."""
        pending = self.waker.starting.get(machine_id) if self.waker is not None else None
        if pending is None:
            return True
        try:
            await asyncio.shield(pending)
        except WakeError:
            return False
        return True

    async def _late_binder(self, app: App, refused: set[str]) -> str | None:
        """Last resort, when every machine refused this request: a `started` machine may not have bound its
        port yet (a process takes a moment after its start): wait for the first such to accept."""
        for machine_id in sorted(refused):
            entry = self.routes.entry(machine_id)
            if entry is None or entry.state != "started" or not (entry.port or app.service.internal_port):
                continue
            address = (self.config.machine_host, self._port(app, entry))
            conn = await connect_when_up(address, self.config.ready_timeout)
            if conn is None:
                return None
            self.pool.put(conn)
            self._bad.pop(machine_id, None)
            refused.discard(machine_id)
            return machine_id
        return None

    async def _wait_for_slot(self, app: str, deadline: float) -> None:
        left = deadline - self.clock()
        if left <= 0 or self._queued.get(app, 0) >= self.config.max_queue:
            raise Refused(503, f"every machine of {app} is at its hard limit", retry_after=1)
        event = self._freed.get(app)
        if event is None:
            event = self._freed[app] = asyncio.Event()
        self._queued[app] = self._queued.get(app, 0) + 1
        try:
            await asyncio.wait_for(event.wait(), left)
        except TimeoutError:
            raise Refused(503, f"every machine of {app} is at its hard limit", retry_after=1) from None
        finally:
            self._queued[app] -= 1

    def _release(self, machine_id: str) -> None:
        left = self.loads.get(machine_id, 1) - 1
        if left:
            self.loads[machine_id] = left
        else:
            self.loads.pop(machine_id, None)
        self.last_used[machine_id] = self.clock()
        entry = self.routes.entry(machine_id)
        if entry is not None:
            event = self._freed.pop(entry.app, None)
            if event is not None:
                event.set()

    def _failed(self, app: App, machine_id: str, why: str) -> None:
        entry = self.routes.entry(machine_id)
        if entry is not None:
            self.pool.drop((self.config.machine_host, self._port(app, entry)))
        first = machine_id not in self._bad
        self._bad[machine_id] = self.clock() + self.config.avoid_for
        self.metrics.refused.labels(app.name).inc()
        if first and self.publish is not None and entry is not None:
            signal = ProxyUnreachable(
                app=app.name,
                machine_id=machine_id,
                worker_id=entry.worker_id,
                region=entry.region,
                proxy_region=self.config.region,
                error=why[:200],
                at=time.time(),
            )
            self.publish(subjects.proxy_unreachable(app.name, machine_id), msgspec.json.encode(signal))

    def _port(self, app: App, entry: Any) -> int:
        return int(app.service.internal_port or entry.port or 0)

    # ------------------------------------------------------------------------------------------
    # forwarding

    async def _forward(
        self,
        ex: Exchange,
        app: App,
        machine_id: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_ip: str,
        upgrade: bool,
        *,
        fresh: bool,
    ) -> None:
        entry = self.routes.entry(machine_id)
        if entry is None or not (app.service.internal_port or entry.port):
            raise _Upstream(f"{machine_id} has no known port", resend=True)
        ex.machine, ex.region = machine_id, entry.region
        address = (self.config.machine_host, self._port(app, entry))
        try:
            conn = await self.pool.get(address, fresh=fresh)
        except OSError as exc:
            raise _Upstream(f"{machine_id}: {exc.strerror or exc}", resend=True) from None
        try:
            await self._exchange(ex, conn, reader, writer, client_ip, upgrade)
            return
        except _Upstream:
            conn.close()
            if ex.waking is not None:  # the kept connection failed before the resume answered: wait for it
                await self._resumed(ex)
            if not (conn.reused and ex.safe):
                raise
        except BaseException:
            conn.close()
            raise
        # a kept connection the machine had closed meanwhile: once more on a new one, same machine
        try:
            conn = await self.pool.get(address, fresh=True)
        except OSError as exc:
            raise _Upstream(f"{machine_id}: {exc.strerror or exc}", resend=True) from None
        try:
            await self._exchange(ex, conn, reader, writer, client_ip, upgrade)
        except BaseException:
            conn.close()
            raise

    async def _exchange(
        self,
        ex: Exchange,
        conn: Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client_ip: str,
        upgrade: bool,
    ) -> None:
        head = ex.head
        conn.writer.write(_upstream_head(head, client_ip, ex.request_id, upgrade))
        sending: asyncio.Future[None] | None = None
        if ex.framing.chunked or ex.framing.length > 0:  # full duplex: the response may begin before the body ends
            sending = asyncio.ensure_future(relay_body(reader, conn.writer, ex.framing))
        try:
            await self._respond(ex, conn, reader, writer, upgrade)
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()

    async def _respond(
        self, ex: Exchange, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upgrade: bool
    ) -> None:
        head = ex.head
        ex.watch.arm(self.config.response_timeout)
        try:
            data = await (self._head_once_resumed(ex, conn) if ex.waking else conn.reader.readuntil(b"\r\n\r\n"))
        except asyncio.CancelledError:
            if not ex.watch.expired():
                raise
            raise Refused(
                504, f"machine {ex.machine} did not answer within {self.config.response_timeout:g}s"
            ) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise _Upstream(f"{ex.machine} closed the connection ({type(exc).__name__})", resend=False) from None
        finally:
            ex.watch.disarm()
        response = parse_response_head(data)
        status = int(response.first)
        while 100 <= status < 200 and status != 101:  # interim responses (100 Continue): pass on, read on
            writer.write(data)
            data = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), self.config.response_timeout)
            response = parse_response_head(data)
            status = int(response.first)
        ex.status = status
        if status == 101 and upgrade:
            ex.client_keep = False
            ex.responded = True
            writer.write(data)
            await _tunnel(reader, writer, conn)
            return
        framing = body_framing(response, request=False) if response_has_body(head.first, status) else Framing(False, 0)
        upstream_keep = b"close" not in response.tokens(b"connection") and framing.length >= 0
        if response.version != b"HTTP/1.1":
            upstream_keep = upstream_keep and b"keep-alive" in response.tokens(b"connection")
        if framing.length < 0:
            ex.client_keep = False
        client_head = _client_head(response, ex, machine=ex.machine or "")
        if not framing.chunked and 0 < framing.length <= CHUNK:  # a small body: head and body in one send
            body = await conn.reader.readexactly(framing.length)
            ex.responded = True
            writer.write(client_head + body)
        else:
            ex.responded = True
            writer.write(client_head)
            await relay_body(conn.reader, writer, framing)
        if upstream_keep:
            self.pool.put(conn)
        else:
            conn.close()
        if writer.transport.get_write_buffer_size():
            await writer.drain()

    @staticmethod
    async def _resumed(ex: Exchange) -> None:
        """Wait for the resume the request went ahead of; `_ResumeFailed` if it failed."""
        waking = ex.waking
        assert waking is not None
        ex.waking = None
        try:
            await asyncio.shield(waking)
        except WakeError as exc:
            raise _ResumeFailed(str(exc)) from None

    @staticmethod
    async def _head_once_resumed(ex: Exchange, conn: Conn) -> bytes:
        """The response head of a request sent ahead of its machine's resume (`_resume_ahead`); `_ResumeFailed`
        if the resume fails first (the machine stays frozen and would never answer)."""
        waking = ex.waking
        assert waking is not None
        head = asyncio.ensure_future(conn.reader.readuntil(b"\r\n\r\n"))
        try:
            await asyncio.wait((head, waking), return_when=asyncio.FIRST_COMPLETED)
            if waking.done():
                failure = asyncio.CancelledError() if waking.cancelled() else waking.exception()
                if failure is not None and not (head.done() and head.exception() is None):
                    raise _ResumeFailed(str(failure) or "the resume was cancelled")
                ex.waking = None  # resumed: what follows is an ordinary exchange
            return await head
        finally:
            head.cancel()


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    """A resume run ahead of its request: its failure is the request's (`_head_once_resumed`), never logged
    by asyncio as unretrieved when the answer came first."""
    if not future.cancelled():
        future.exception()


_NONE: set[str] = set()  # no machine avoided (never changed)
_REQUEST_IDS = itertools.count(1)
_ID_PREFIX = secrets.token_hex(4)  # this process's: ids from many proxies do not collide


def _request_id() -> str:
    """16 hex digits, unique per proxy process: a random prefix and a count (a token per request cost more)."""
    return f"{_ID_PREFIX}{next(_REQUEST_IDS) & 0xFFFFFFFF:08x}"


def _dropped(head: Head, upgrade: bool) -> set[bytes]:
    drop = set(HOP_BY_HOP) | head.tokens(b"connection")
    if upgrade:
        drop -= {b"upgrade"}
    return drop


def _upstream_head(head: Head, client_ip: str, request_id: str, upgrade: bool) -> bytes:
    drop = _dropped(head, upgrade) | {b"x-forwarded-proto", b"x-forwarded-host", b"fauxmad-request-id"}
    lines = [head.first, b" ", head.target, b" HTTP/1.1\r\n"]
    forwarded_for = client_ip.encode()
    for name, value in head.headers:
        if name in drop:
            continue
        if name == b"x-forwarded-for":
            forwarded_for = value + b", " + forwarded_for
            continue
        lines += [name, b": ", value, b"\r\n"]
    lines += [b"x-forwarded-for: ", forwarded_for, b"\r\nx-forwarded-proto: http\r\n"]
    host = head.get(b"host")
    if host is not None:
        lines += [b"x-forwarded-host: ", host, b"\r\n"]
    lines += [b"fauxmad-request-id: ", request_id.encode(), b"\r\n"]
    if upgrade:
        lines.append(b"connection: upgrade\r\n")
    if head.version == b"HTTP/1.0" and not upgrade:
        pass  # spoken upstream as HTTP/1.1: the machine's connection stays reusable
    lines.append(b"\r\n")
    return b"".join(lines)


def _client_head(response: Head, ex: Exchange, *, machine: str) -> bytes:
    drop = set(HOP_BY_HOP) | response.tokens(b"connection")
    lines = [b"HTTP/1.1 ", response.first, b" ", response.target, b"\r\n"]
    for name, value in response.headers:
        if name not in drop:
            lines += [name, b": ", value, b"\r\n"]
    lines += [b"fauxmad-request-id: ", ex.request_id.encode(), b"\r\nfauxmad-machine: ", machine.encode()]
    lines.append(b"\r\nconnection: keep-alive\r\n\r\n" if ex.client_keep else b"\r\nconnection: close\r\n\r\n")
    return b"".join(lines)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(64 * 1024):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.write_eof()


async def _tunnel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Conn) -> None:
    """After `101 Switching Protocols` (WebSocket): bytes both ways until either side is done."""
    up = asyncio.ensure_future(_pipe(reader, conn.writer))
    down = asyncio.ensure_future(_pipe(conn.reader, writer))
    try:
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down):
            task.cancel()
        conn.close()
