"""Serve the API: connect to NATS, build the application, listen until cancelled."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web
from prometheus_client import start_http_server

from bus.connection import connect
from orchestrator.api.server import build


def read_token(path: Path | None) -> bytes | None:
    if path is None:
        return None
    token = path.read_text().strip().encode()
    if not token:
        raise ValueError(f"{path} holds no token")
    return token


async def serve(
    nats_url: str, host: str, port: int, *, token: bytes | None = None, metrics: tuple[str, int] | None = None
) -> None:
    if metrics is not None:
        start_http_server(metrics[1], metrics[0])
    nc = await connect(nats_url, "fauxmad-api")
    runner = web.AppRunner(build(nc, token=token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await nc.close()
