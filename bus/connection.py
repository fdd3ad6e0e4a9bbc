"""Connecting to NATS with settings that suit long-running agents and short CLI calls alike.

Agents (workers, brokers) reconnect forever with a short wait, so a NATS restart is a blip. A CLI
call should fail at once with a plain sentence when the server is not there: `connect` raises
`Unreachable` naming the URL rather than letting nats-py print connection tracebacks.

nats-py reconnects after a dropped socket, but a server `-ERR` (a payload over max_payload, an invalid
subject) closes the client for good. An agent must never stay alive but deaf, so agents pass
`on_closed`: it is called when the connection ends without the agent having asked, and the agent exits
non-zero for its supervisor (systemd, `fauxmad dev`) to restart it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import nats
from nats.aio.client import Client

from bus import credentials
from bus.errors import Unreachable

log = logging.getLogger(__name__)

DEFAULT_URL_ENV = "FAUXMAD_NATS_URL"


def default_url() -> str | None:
    return os.environ.get(DEFAULT_URL_ENV) or None


async def _quiet_error(exc: Exception) -> None:
    log.debug("nats: %r", exc)


async def connect(
    url: str,
    name: str,
    *,
    agent: bool = False,
    timeout: float = 2.0,
    on_closed: Callable[[str], None] | None = None,
    creds: str | None = None,
) -> Client:
    """Connect to `url`. `agent=True`: reconnect forever; otherwise fail fast when unreachable.

    `on_closed(reason)` runs whenever the connection ends for good, including the caller's own `close()`:
    an agent ignores it while it is shutting down. `creds` (default: `$FAUXMAD_CREDS`) is a secure fleet's
    credentials file (`bus.credentials`): the connection is then that identity, over mutual TLS.
    """
    client: Client | None = None
    secure: dict[str, Any] = {}
    creds_path = creds or credentials.default_path()
    if creds_path:
        identity, base = credentials.load(creds_path)
        secure = identity.connect_options(base)

    async def closed() -> None:
        if on_closed is not None:
            why = client.last_error if client is not None else None
            on_closed(f"the NATS connection was closed: {why or 'by the server'}")

    try:
        client = await nats.connect(
            servers=[url],
            name=name,
            connect_timeout=timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1 if agent else 3,
            reconnect_time_wait=0.25 if agent else 0.1,
            ping_interval=5 if agent else 20,
            max_outstanding_pings=3,
            error_cb=_quiet_error,
            pending_size=64 * 1024 * 1024,
            closed_cb=closed,
            **secure,
        )
        return client
    except Exception as exc:
        raise Unreachable(f"cannot reach NATS at {url}: {exc.__class__.__name__} {exc}".strip()) from None
