"""One client connection at a time: read a request, choose a machine, forward it, relay the answer.

Everything the proxy refuses is answered here, by the proxy, in one line of text and then the connection
is closed: 400 (no or bad Host, malformed head), 404 (no such app), 408 (a head that does not arrive in
time: slowloris), 431 (a head too big), 502 (no machine could take it, and why), 503 (every machine at
its hard limit through the bounded wait; Retry-After), 504 (the machine did not answer in time). An
exception from a handler becomes a 502 if nothing was sent yet, else the connection is cut: never a
traceback to a client and never a connection left hanging.

The parts: `pick` chooses and wakes a machine (`ahead` when a suspended one is resumed with the request
on its way), `forward` sends the request and relays the answer, `failover` avoids and reports a machine
that failed. Here is the loop over them: a request that failed on a machine goes to another when
nothing was sent upstream yet (or when it is idempotent and has no body: it can be sent again).
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

from orchestrator.proxy.ahead import ResumeFailed
from orchestrator.proxy.config import ProxyConfig
from orchestrator.proxy.deadlines import Deadlines, Watch
from orchestrator.proxy.exchange import Exchange, Refused
from orchestrator.proxy.failover import Failover
from orchestrator.proxy.forward import Forwarder, UpstreamFailed
from orchestrator.proxy.http import MAX_HEAD, HttpError, error_response, split_host
from orchestrator.proxy.metrics import ProxyMetrics
from orchestrator.proxy.pick import Picker
from orchestrator.proxy.request import parse_request
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Pool
from orchestrator.proxy.wake import Waker

log = logging.getLogger(__name__)

IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})
ATTEMPTS = 4


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
        self.failover = Failover(config, routes, self.pool, self.metrics, publish, clock)
        self.picker = Picker(config, routes, waker, self.pool, self.failover, clock, self.rng)
        self.forwarder = Forwarder(config, routes, self.pool)
        self.loads = self.picker.loads  # read by the idle stopper
        self.last_used = self.picker.last_used
        self.deadlines = Deadlines(clock)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client_ip = peer[0] if isinstance(peer, tuple) else ""
        held: list[str] = []  # concurrency type `connections`: the machine this connection holds
        watch = self.deadlines.watch()
        try:
            first = True
            while True:
                data = await self._read_head(reader, writer, first, watch)
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
                self.picker.release(machine_id)
            with contextlib.suppress(Exception):
                writer.close()

    async def _read_head(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bool, watch: Watch
    ) -> bytes | None:
        """The next request head. A kept connection may idle up to the keep-alive timeout, but from a head's
        first byte on, every head has the head timeout, the first as the hundredth (slowloris)."""
        config = self.config
        begun = first
        watch.arm(config.head_timeout if first else config.keepalive_timeout)  # no timer per read: the hot path
        try:
            if first:
                return await reader.readuntil(b"\r\n\r\n")
            byte = await reader.readexactly(1)
            begun = True
            watch.arm(config.head_timeout)
            return byte + await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        except asyncio.LimitOverrunError:
            self._refuse(writer, 431, f"request head over {MAX_HEAD} bytes", _request_id())
        except asyncio.CancelledError:
            if not watch.expired():
                raise
            if not begun:  # an idle keep-alive connection: just close it
                return None
            self._refuse(writer, 408, "the request head did not arrive in time", _request_id())
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
            ex = Exchange(parse_request(data), request_id, watch)
            await self._serve(ex, reader, writer, client_ip, held)
            return ex.client_keep
        except (HttpError, Refused) as exc:
            status = exc.status
            message = exc.reason if isinstance(exc, HttpError) else exc.message
            retry = exc.retry_after if isinstance(exc, Refused) else None
            if ex is not None:
                ex.status = status
            if ex is None or not ex.responded:
                self._refuse(writer, status, message, request_id, retry)
                with contextlib.suppress(Exception):
                    await writer.drain()
            return False
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            if ex is not None and not ex.responded:
                ex.status = 502
                app = ex.app or "the app"
                self._refuse(writer, 502, f"no machine of {app} could take this request ({exc})", request_id)
            return False
        except Exception:
            log.exception("proxy: request %s failed", request_id)
            if ex is not None and not ex.responded:
                ex.status = 502
                self._refuse(writer, 502, "the proxy failed to forward this request", request_id)
            return False
        finally:
            if ex is not None and ex.app:
                self.metrics.observe(ex.app, ex.region, ex.status, self.clock() - began)

    def _refuse(
        self, writer: asyncio.StreamWriter, status: int, message: str, request_id: str, retry: int | None = None
    ) -> None:
        """The proxy's own answer (then the connection closes), counted by code in /metrics: a refusal that names
        no app (a 400, a 404 for an unknown one, a 408 or 431 before any head) has no other trace there."""
        writer.write(error_response(status, message, request_id, retry_after=retry))
        self.metrics.refusal(status)

    async def _serve(
        self, ex: Exchange, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client_ip: str, held: list[str]
    ) -> None:
        head = ex.head
        host = ex.request.authority
        if host is None:
            raise HttpError(400, "a Host header is required")
        name = split_host(host, self.config.domain)
        if name is None:
            raise HttpError(
                404 if b"." in host else 400, f"no app is served at this host (use <app>.{self.config.domain})"
            )
        app = self.routes.app(name) or await self.routes.fetch_app(name)
        if app is None:
            raise Refused(404, f"unknown app {name}")
        ex.app = name
        connection = head.tokens(b"connection")
        ex.client_keep = b"close" not in connection if head.version == b"HTTP/1.1" else b"keep-alive" in connection
        upgrade = b"upgrade" in connection and head.get(b"upgrade") is not None
        prefer = head.get(b"fauxmad-prefer-region")
        sticky = app.service.concurrency.type == "connections"
        picker = self.picker
        if sticky and held and picker.routable(app.name, held[0]) is None:
            picker.release(held.pop())
        ex.safe = safe = head.first in IDEMPOTENT and not ex.framing.chunked and ex.framing.length == 0
        avoid: set[str] = set()
        deadline = self.clock() + self.config.queue_timeout
        for attempt in range(ATTEMPTS):
            ex.waking = None  # a failed attempt's resume is not this one's
            if sticky and held:
                machine_id = held[0]
            else:
                machine_id = await picker.pick(
                    app, prefer.decode("ascii", "replace") if prefer else None, avoid, deadline, ex
                )
                self.loads[machine_id] = self.loads.get(machine_id, 0) + 1
                if sticky:
                    held.append(machine_id)
            try:
                await self.forwarder.forward(ex, app, machine_id, reader, writer, client_ip, upgrade, fresh=attempt > 0)
                return
            except (UpstreamFailed, ResumeFailed) as failure:
                avoid.add(machine_id)
                if sticky and held:
                    held.pop()
                    picker.release(machine_id)
                if not self._may_retry(app, machine_id, failure, safe) or attempt == ATTEMPTS - 1:
                    raise Refused(502, f"no machine of {app.name} could take this request ({failure})") from None
            finally:
                if not sticky:
                    picker.release(machine_id)

    def _may_retry(self, app: App, machine_id: str, failure: UpstreamFailed | ResumeFailed, safe: bool) -> bool:
        """Account for a machine that failed a request; whether the request may go to another."""
        if isinstance(failure, ResumeFailed):  # as a resume that failed before the request went
            log.warning("proxy: %s", failure)
            return True
        self.failover.failed(app, machine_id, str(failure), refused=failure.refused)
        return failure.resend or safe


_REQUEST_IDS = itertools.count(1)
_ID_PREFIX = secrets.token_hex(4)  # this process's: ids from many proxies do not collide


def _request_id() -> str:
    """16 hex digits, unique per proxy process: a random prefix and a count (a token per request cost more)."""
    return f"{_ID_PREFIX}{next(_REQUEST_IDS) & 0xFFFFFFFF:08x}"
