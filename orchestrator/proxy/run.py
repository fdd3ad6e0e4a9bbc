"""`fauxmad proxy`: one process that connects to NATS, fills the route table and listens.

It holds no state of its own worth keeping: kill it and start another, or run ten. Its NATS connection
reads three KV buckets (watches), publishes failover signals, and asks the brokers to start, create and
stop machines only when a request (or idleness) needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import time

import msgspec

from bus.contract import subjects
from bus.contract.codec import decoder, encode
from bus.contract.edge import ProxyActivity
from bus.transport import credentials
from bus.transport.addresses import host_addresses, source_address_for_url
from bus.transport.connection import connect, role_of
from bus.transport.jetstream import ensure_fleet_resources_patiently
from bus.transport.nats_adapter import Msg, Nats
from orchestrator.client import FleetClient
from orchestrator.proxy.backhaul import Dialer
from orchestrator.proxy.config import ProxyConfig
from orchestrator.proxy.http import MAX_HEAD
from orchestrator.proxy.idle import IdleStopper
from orchestrator.proxy.metrics import ProxyMetrics, serve_admin
from orchestrator.proxy.routes import RouteTable
from orchestrator.proxy.server import Proxy
from orchestrator.proxy.upstream import Pool
from orchestrator.proxy.wake import Waker, Woken

log = logging.getLogger(__name__)


class Listen(msgspec.Struct, frozen=True):
    host: str
    port: int


def parse_listen(text: str) -> Listen:
    """`127.0.0.1:8080`, `:8080` (all interfaces) or `8080`."""  # local: an example
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"invalid address {text!r}: use HOST:PORT")
    return Listen(host.strip("[]") or "0.0.0.0", int(port))


async def run_proxy(
    config: ProxyConfig,
    nats_url: str,
    listen: Listen,
    *,
    admin: Listen | None = None,
    autostop_interval: float = 1.0,
    ready: asyncio.Event | None = None,
) -> None:
    nc = await connect(nats_url, "fauxmad-proxy", reconnect_forever=True)
    routes = RouteTable()
    metrics = ProxyMetrics()
    dialer = Dialer(
        routes.registry.in_region, local=_own_addresses(nats_url), always=config.backhaul_always, tls=_backhaul_tls()
    )
    pool = Pool(dialer, machine_host=config.machine_host)
    dialer.on_suspect = lambda host: pool.drop_host(*host)
    try:
        kv = await ensure_fleet_resources_patiently(nc.jetstream())
        await routes.start(kv)
        # as a proxy identity (a secure fleet's `proxy` role) it may ask only the brokers' edge verbs
        client = FleetClient(nc, edge=role_of(nc) == "proxy")
        waker = Waker(
            client,
            routes,
            pool,
            ready_timeout=config.ready_timeout,
            on_woken=lambda woken: _woken(metrics, woken),
        )

        sending: set[asyncio.Future[None]] = set()

        def publish(subject: str, payload: bytes) -> None:
            future = asyncio.ensure_future(nc.publish(subject, payload))
            sending.add(future)
            future.add_done_callback(sending.discard)

        proxy = Proxy(config, routes, waker, pool=pool, metrics=metrics, publish=publish)
        me = f"proxy-{secrets.token_hex(4)}"

        def share(app: str, machines: list[str]) -> None:
            publish(subjects.proxy_activity(app), encode(ProxyActivity(proxy=me, app=app, machines=machines)))

        async def on_activity(msg: Msg) -> None:
            try:
                report = decoder(ProxyActivity).decode(msg.data)
            except msgspec.DecodeError:
                return  # a plain publish has nobody to answer: a malformed report is dropped
            if report.proxy != me:
                stopper.heard(report.machines)

        stopper = IdleStopper(
            routes,
            client,
            proxy.loads,
            proxy.last_used,
            region=config.region,
            latency=config.latency,
            clock=time.monotonic,
            on_stopped=lambda app, machine_id, why: _stopped(metrics, app, machine_id, why),
            share=share,
            waking=proxy.waker.waking if proxy.waker is not None else frozenset,
        )
        await nc.subscribe(subjects.PROXY_ACTIVITY_ALL, cb=on_activity)
        server = await asyncio.start_server(proxy.handle, listen.host, listen.port, limit=MAX_HEAD, backlog=1024)
        admin_server = await serve_admin(metrics, admin.host, admin.port) if admin is not None else None
        idle_task = asyncio.ensure_future(stopper.run(autostop_interval))
        bound = server.sockets[0].getsockname()
        log.info("proxy: listening on %s:%s for *.%s (region %s)", bound[0], bound[1], config.domain, config.region)
        print(f"fauxmad proxy: listening on {bound[0]}:{bound[1]}, region {config.region}", flush=True)
        if ready is not None:
            ready.set()
        try:
            await asyncio.Event().wait()  # until cancelled: the CLI's `serve` cancels it on SIGINT or SIGTERM
        finally:
            idle_task.cancel()
            server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proxy.deadlines.close(), 0.2)
            if admin_server is not None:
                admin_server.close()
    finally:
        dialer.close()
        pool.close()
        with contextlib.suppress(Exception):  # a TimeoutError too: what is not done by then is left undone
            await asyncio.wait_for(_close(routes, nc), STOP_BUDGET)


# One line on stdout per machine the proxy woke or stopped (beside the listening line): an operator sees why a
# machine started or stopped without turning on logging. App names and machine ids are tokens (the contract's
# patterns), so nothing here is text a client chose.
PAST = {"start": "started", "resume": "resumed", "create": "created"}


def _woken(metrics: ProxyMetrics, woken: Woken) -> None:
    metrics.woken.labels(woken.app, woken.kind).inc()
    print(
        f"fauxmad proxy: autostart: {PAST.get(woken.kind, woken.kind)} machine {woken.machine_id} of app {woken.app}"
        f" in {woken.region}: {woken.why}",
        flush=True,
    )


def _stopped(metrics: ProxyMetrics, app: str, machine_id: str, why: str) -> None:
    metrics.stopped.labels(app).inc()
    print(f"fauxmad proxy: autostop: machine {machine_id} of app {app} {why}", flush=True)


# The stop (SIGTERM): the CLI ends the proxy 1 s after the signal whatever it is doing (`STATELESS_GRACE`, for
# the 2 s promised); the route table's watches and NATS's close get this much of it (the connections in flight
# are cut: the proxy keeps nothing, and a client retries elsewhere).
STOP_BUDGET = 0.5


async def _close(routes: RouteTable, nc: Nats) -> None:
    await routes.close()
    await nc.close()


def _own_addresses(nats_url: str) -> set[str]:
    """This host's addresses: a machine whose worker advertises one of them is dialed on loopback, directly."""
    found = host_addresses()
    with contextlib.suppress(OSError):
        found.add(source_address_for_url(nats_url))
    return found


def _backhaul_tls() -> ssl.SSLContext | None:
    """Mutual TLS with the fleet's CA for the backhaul, from this proxy's credentials (a secure fleet), else None."""
    path = credentials.default_path()
    if not path:
        return None
    creds, base = credentials.load(path)
    return creds.backhaul_client_context(base)
