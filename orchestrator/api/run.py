"""Serve the API: connect to NATS, start the embedded broker, build the application, listen until cancelled (the
CLI's `serve` cancels it on SIGTERM or SIGINT) or the broker's connection ends for good (then exit non-zero for the
supervisor). No server at start is one line and exit 3; once connected it reconnects forever.

HTTPS: with a certificate and its key (`--tls-cert`/`--tls-key`) the listener serves TLS itself. On a secure fleet
the default is the certificate the fleet's CA issued to the API's identity for it (`fauxmad fleet add-user NAME
--role api` writes `creds/NAME-https.pem` beside the credentials; see `orchestrator.security.fleetdir`): the
console's cookie then travels encrypted and is marked `Secure`.

On the way out the server closes its listener and waits for the audit records still being acknowledged
(`AuditTrail.drain`), then closes the NATS connection, which flushes what it still holds."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from prometheus_client import start_http_server

from bus.contract.errors import Unreachable
from bus.transport import credentials
from bus.transport.connection import connect
from bus.transport.jetstream import ensure_audit_stream, revoked_tokens_bucket
from bus.transport.nats_adapter import Nats
from orchestrator.api.auth import Auth, RevokedTokens
from orchestrator.api.server import build
from orchestrator.broker.service import Broker, BrokerConfig
from orchestrator.security.tokens import KEY_BYTES


def read_token(path: Path | None) -> bytes | None:
    if path is None:
        return None
    token = path.read_text().strip().encode()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token


def read_root_key(path: Path | None) -> bytes | None:
    """The fleet's token root key (`fauxmad token mint` makes it), checked for its size."""
    if path is None:
        return None
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} is not a token key ({KEY_BYTES} bytes; `fauxmad token mint --key {path}` makes one)")
    return key


def https_files(name: str, base: Path) -> tuple[Path, Path]:
    """Where the HTTPS certificate and key the fleet's CA issued to API identity `name` are (beside its
    credentials file, in `base`)."""
    return base / f"{name}-https.pem", base / f"{name}-https-key.pem"


def fleet_certificate(nats_url: str, creds: str | None = None) -> tuple[Path, Path] | None:
    """The HTTPS certificate and key of this process's identity on a secure fleet (`creds`, default
    `$FAUXMAD_CREDS`), or None: an open fleet, or an identity the CA issued none to (not of role `api`)."""
    path = creds or credentials.default_path()
    if not nats_url.startswith("tls://") or not path:
        return None
    identity, base = credentials.load(path)
    cert, key = https_files(identity.name, base)
    return (cert, key) if cert.exists() and key.exists() else None


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server's TLS context for `cert` (PEM, with its chain) and its `key`; `ValueError` in words if they do not
    load (missing, unreadable, or not a pair)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except ssl.SSLError as exc:  # an OSError too: first
        raise ValueError(f"{cert} and {key} are not a certificate and its key ({exc.reason or exc})") from None
    except FileNotFoundError as exc:
        raise ValueError(f"cannot read {exc.filename or cert}: no such file") from None
    except OSError as exc:
        raise ValueError(f"cannot read {cert} or {key}: {exc.strerror or exc}") from None
    return context


# The stop (SIGTERM) of a process that keeps nothing: the CLI ends it 1 s after the signal whatever it is doing
# (`STATELESS_GRACE`, for the 2 s promised), so the stop fits inside that with a margin. Under load the embedded
# broker's drain (up to 2 s) and NATS's close (2 s) came on top of aiohttp's 1 s wait for requests in flight.
STOP_BUDGET = 0.7
SHUTDOWN_TIMEOUT = 0.4  # of which requests in flight may take this long to finish (then they are cancelled)


async def _stop(runner: web.AppRunner | None, revoked: RevokedTokens, broker: Broker, nc: Nats) -> None:
    """The HTTP side first (requests in flight finish, with their audit records' acks), then the broker and NATS."""
    if runner is not None:
        await runner.cleanup()
    await revoked.close()
    await broker.close()
    await nc.close()


async def serve(
    nats_url: str,
    host: str,
    port: int,
    *,
    token: bytes | None = None,
    root_key: bytes | None = None,
    metrics: tuple[str, int] | None = None,
    tls: ssl.SSLContext | None = None,
    extend: Callable[[web.Application, Auth], None] | None = None,
) -> None:
    """Serve the API until cancelled. `extend` adds what is served beside it with the same tokens (the CLI passes the
    web console's routes, `orchestrator.console.routes.attach`: the console stands on the API, not the reverse)."""
    if metrics is not None:
        start_http_server(metrics[1], metrics[0])
    nc = await connect(nats_url, "fauxmad-api", reconnect_forever=True)
    revoked = RevokedTokens()
    broker = Broker(BrokerConfig(nats_url=nats_url, name=f"api-{secrets.token_hex(4)}"))
    runner: web.AppRunner | None = None
    try:  # until cancelled (SIGTERM/SIGINT: the CLI's `serve`), or the embedded broker's connection is gone for good
        js = nc.jetstream()
        await ensure_audit_stream(js)
        if root_key is not None:
            await revoked.start(await revoked_tokens_bucket(js))
        auth = Auth(static_token=token, root_key=root_key, revoked=revoked)
        await broker.start(serve=False)  # placements happen here, as Fly's flaps does them (orchestrator.api.http)
        app = build(nc, auth=auth, broker=broker)
        if extend is not None:
            extend(app, auth)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=tls)
        await site.start()
        bound = runner.addresses[0] if runner.addresses else (host, port)
        where = f"[{bound[0]}]:{bound[1]}" if ":" in str(bound[0]) else f"{bound[0]}:{bound[1]}"
        secured = "bearer tokens required" if token is not None or root_key is not None else "no token required"
        print(
            f"fauxmad api: listening on {'https' if tls else 'http'}://{where} "
            "(Fly's Machines API under /v1, /openapi.json, /docs; "
            f"the console at /ui; {secured})",
            flush=True,
        )
        await broker.run_forever()
    finally:  # stop as a whole, within STOP_BUDGET: the audit records' acks are awaited first
        with contextlib.suppress(Exception):  # a TimeoutError too: what is not done by then is left undone
            await asyncio.wait_for(_stop(runner, revoked, broker, nc), STOP_BUDGET)
    if broker.bus_lost:
        raise Unreachable(f"the API's broker stopped: {broker.bus_lost}")
