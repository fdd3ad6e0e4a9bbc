"""Connecting to NATS with settings that suit long-running agents and short CLI calls alike.

Agents (workers, brokers) reconnect forever with a short wait, so a NATS restart is a blip. A CLI
call should fail at once with a plain sentence when the server is not there: `connect` raises
`Unreachable` naming the URL rather than letting nats-py print connection tracebacks. A command that may
run for long (the operator, `reconcile --watch`, and the deploys of the same reconciler) is both: it fails
fast when the server is not there, and once connected it reconnects like an agent (`reconnect_forever`).
Both kinds take their settings from one place, `reconnect_options`.

nats-py reconnects after a dropped socket, but a server `-ERR` (a payload over max_payload, an invalid
subject) closes the client for good. An agent must never stay alive but deaf, so agents pass
`on_closed`: it is called when the connection ends without the agent having asked, and the agent exits
non-zero for its supervisor (systemd, `fauxmad dev`) to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from bus.contract.errors import Forbidden, Unreachable
from bus.transport import credentials
from bus.transport.in_flight import when_disconnected
from bus.transport.nats_adapter import Connection, reconnected, role_of
from bus.transport.refusals import Refusals
from bus.transport.signing import RequestSigner

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_URL_ENV = "FAUXMAD_NATS_URL"


__all__ = ["Connection", "connect", "default_url", "reconnect_options", "role_of", "servers"]


class _SslCloseNoise(logging.Filter):
    """asyncio warns on every TLS connection nats-py closes ("returning true from eof_received() has no
    effect when using ssl"): noise on every CLI call of a secure fleet, dropped here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_SslCloseNoise())


def servers(url: str) -> list[str]:
    """The server URLs in `url`: one, or several comma-separated (a region's cluster in a supercluster)."""
    return [part.strip() for part in url.split(",") if part.strip()]


def default_url() -> str | None:
    return os.environ.get(DEFAULT_URL_ENV) or None


async def _quiet_error(exc: Exception) -> None:
    log.debug("nats: %r", exc)


def _identity(url: str, creds: str | None) -> tuple[dict[str, Any], Refusals | None, RequestSigner | None, str | None]:
    """A secure connection's connect options, its refusals watch, its request signer and its role (none for an
    open one). $FAUXMAD_CREDS is for secure (tls://) fleets: a plain URL given alongside it is an open fleet."""
    creds_path = creds or (credentials.default_path() if url.startswith("tls://") else None)
    if not creds_path:
        return {}, None, None, None
    identity, base = credentials.load(creds_path)
    signer = RequestSigner(identity.seed, identity.name)
    return identity.connect_options(base), Refusals(identity.name), signer, identity.role


# How a long-running process (worker, broker, operator, API, edge proxy, `status --watch`) notices that its
# server is gone without a word (its host's cable cut, a partition: no FIN, no RST, only silence): a PING every
# AGENT_PING_INTERVAL, and the connection is stale when AGENT_MAX_PINGS of them are unanswered at the next tick,
# so (AGENT_MAX_PINGS + 1) x AGENT_PING_INTERVAL = 3 to 4 s after the last PONG it reconnects to another server
# of the cluster. It was 5 s x 3 (15 to 20 s): with a host cut, a worker connected through that host's server
# answered no reserve for that long, and the keyed creates of tests/hosts/test_cluster_on_hosts.py took 93 s.
# A busy event loop does not make a false alarm: the ticks and the PONGs wait for the same loop, and a stale
# connection takes unanswered ticks in a row. The cost: one PING and PONG (6 bytes each) a second a process.
AGENT_PING_INTERVAL = 1.0
AGENT_MAX_PINGS = 3  # not 2: a nats-server starved of CPU for 2 s on a loaded host is slow, not gone


def reconnect_options(agent: bool) -> dict[str, Any]:
    """nats-py's reconnect settings: an agent's (reconnect forever, a quarter second apart, and a silent server
    noticed 3 to 4 s after its last answer) or a command's (a few tries, then the connection closes)."""
    return {
        "allow_reconnect": True,
        "max_reconnect_attempts": -1 if agent else 3,
        "reconnect_time_wait": 0.25 if agent else 0.1,
        "ping_interval": AGENT_PING_INTERVAL if agent else 20,
        "max_outstanding_pings": AGENT_MAX_PINGS if agent else 3,
    }


async def connect(
    url: str,
    name: str,
    *,
    agent: bool = False,
    reconnect_forever: bool = False,
    timeout: float = 2.0,
    on_closed: Callable[[str], None] | None = None,
    creds: str | None = None,
) -> Connection:
    """Connect to `url`. `agent=True`: reconnect forever; otherwise fail fast when unreachable.

    `reconnect_forever=True` (a command that may run for long): fail fast when unreachable, as a command does,
    and once connected reconnect as an agent does. `on_closed(reason)` runs whenever the connection ends for
    good, including the caller's own `close()`: an agent ignores it while it is shutting down. `creds`
    (default: `$FAUXMAD_CREDS`) is a secure fleet's credentials file (`bus.transport.credentials`): the
    connection is then that identity, over mutual TLS.
    """
    client: Connection | None = None
    secure, refusals, signing, role = _identity(url, creds)

    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        if refusals is not None:
            refusals.noted(exc)
        if client is None:  # still connecting: kept to say why it failed
            errors.append(str(exc))
        await _quiet_error(exc)

    told: list[bool] = []

    async def closed() -> None:
        if on_closed is not None and not told:
            told.append(True)
            why = client.last_error if client is not None else None
            on_closed(f"the NATS connection was closed: {why or 'by the server'}")

    if url.startswith("tls://") and not secure:
        raise Forbidden(f"{url} is a secure fleet: set {credentials.CREDS_ENV} to this identity's credentials file")
    # nats-py can wait forever on a TLS handshake that will not complete (a plain client told by the server
    # that TLS is required): a command gets a bounded wait; an agent keeps trying, as it does on any failure
    bound = None if agent else 4 * timeout + 2
    options = reconnect_options(agent)
    if reconnect_forever:
        # pings as an agent's from the start: nats-py's ping loop sleeps its first interval as set here, so a
        # command's 20 s left a new worker or broker deaf for 20 s or more to a server gone silent (a host's
        # cable cut in a fleet's first seconds: tests/hosts/test_cluster_on_hosts.py's creates waited on it)
        options.update(ping_interval=AGENT_PING_INTERVAL, max_outstanding_pings=AGENT_MAX_PINGS)
    try:
        # a secure connection's every request watches for the server's refusal (`Connection.request`)
        made = Connection()
        connecting = made.connect(
            servers=servers(url),
            name=name,
            connect_timeout=timeout,  # type: ignore[arg-type]  # nats-py's hint says int; it takes seconds as any number
            error_cb=on_error,
            pending_size=64 * 1024 * 1024,
            closed_cb=closed,
            disconnected_cb=when_disconnected(made),  # requests in flight end then (`bus.transport.in_flight`)
            reconnected_cb=_when_reconnected(made),  # its reconnect hooks (`nats_adapter.on_reconnect`)
            **options,
            **secure,
        )
        await asyncio.wait_for(connecting, bound)
        client = made
        # with `reconnect_forever` the first connection failed fast, and from now on it rides out an outage:
        # nats-py reads these options at every reconnect (and the ping interval at every ping)
        client.options.update(reconnect_options(agent=agent or reconnect_forever))
        # the refusals watch; the signer (its API requests name it to the audit trail); the role (e.g. which
        # way it writes images, `bus.stores.image_push`)
        client.refusals, client.signer, client.role = refusals, signing, role
        _notice_closed(client, closed, on_closed is not None)  # nats-py may skip `closed_cb`: ask the connection too
        return client
    except TimeoutError:
        hint = "" if secure else f" (a secure fleet needs its credentials: {credentials.CREDS_ENV})"
        raise Unreachable(f"cannot reach NATS at {url}: no connection within {bound:g}s{hint}") from None
    except Exception as exc:
        if any("authorization violation" in error.lower() for error in errors):
            raise Forbidden(
                f"NATS at {url} refused these credentials (authorization violation): unknown, revoked or not for"
                " this server"
            ) from None
        raise Unreachable(f"cannot reach NATS at {url}: {_why_unreachable(errors, exc)}") from None


def _when_reconnected(client: Connection) -> Callable[[], Awaitable[None]]:
    async def back() -> None:
        reconnected(client)

    return back


def _why_unreachable(errors: list[str], exc: Exception) -> str:
    """Why connecting failed, in words (the last socket error nats-py reported, never an exception's name)."""
    why = re.sub(r"^\[Errno -?\d+\]\s*", "", errors[-1]) if errors else str(exc).removeprefix("nats: ")
    why = why.strip() or "no server answered"
    return why[0].lower() + why[1:]


CLOSED_POLL = 1.0  # seconds between two looks at whether a connection closed without saying so


def _notice_closed(client: Connection, closed: Callable[[], Awaitable[None]], wanted: bool) -> None:
    """If `wanted`: call `closed` once the connection is closed for good, even if nats-py never calls its closed
    callback: under uvloop its close can fail halfway (writing what is pending to the dead socket raises) and skip
    the callback, and an agent relying on it alone would stay alive but deaf. `closed` runs once either way."""
    if not wanted:
        return

    async def noticing() -> None:
        while not client.is_closed:
            await asyncio.sleep(CLOSED_POLL)
        await closed()

    client.noticing = asyncio.create_task(noticing())  # held: a task nobody holds may vanish
