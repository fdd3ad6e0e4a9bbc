"""Serve the API: connect to NATS, build the application, listen until cancelled."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web
from prometheus_client import start_http_server

from bus.connection import connect
from bus.jetstream import ensure_audit_stream, revoked_tokens_bucket
from orchestrator.api.auth import Auth, RevokedTokens
from orchestrator.api.server import build
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


async def serve(
    nats_url: str,
    host: str,
    port: int,
    *,
    token: bytes | None = None,
    root_key: bytes | None = None,
    metrics: tuple[str, int] | None = None,
) -> None:
    if metrics is not None:
        start_http_server(metrics[1], metrics[0])
    nc = await connect(nats_url, "fauxmad-api")
    js = nc.jetstream()
    await ensure_audit_stream(js)
    revoked = RevokedTokens()
    if root_key is not None:
        await revoked.start(await revoked_tokens_bucket(js))
    auth = Auth(static_token=token, root_key=root_key, revoked=revoked)
    runner = web.AppRunner(build(nc, auth=auth), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await revoked.close()
        await nc.close()
