"""Resume a suspended machine while its request is already on the way: the resume-ahead path.

A frozen process's sockets still queue what is written to them: the request goes on a connection
kept from before the machine was frozen as soon as the resume is asked for, and the machine reads
it the moment it continues. The first byte then waits for the resume's signal, not for its answer
to travel back and a request to travel after it (two legs through NATS to a core gone idle: about a
millisecond). Only for a request that changes nothing (`AHEAD`): if the resume fails, the connection
is closed and the request goes elsewhere, and a machine continued later may still read it once.

`pick` begins it (`resume_ahead`), `forward` waits on it beside the response head (`head_once_resumed`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.proxy.config import machine_port
from orchestrator.proxy.exchange import Exchange
from orchestrator.proxy.routes import App, RouteTable
from orchestrator.proxy.upstream import Conn, Pool
from orchestrator.proxy.wake import WakeError, Waker

# sent ahead of a resume: a request a frozen machine may still read much later must change nothing;
# an idempotent PUT or DELETE read after newer writes would undo them
AHEAD = frozenset({b"GET", b"HEAD", b"OPTIONS"})


class ResumeFailed(Exception):
    """The resume a request was sent ahead of failed: the machine never read it; the reason."""


def resume_ahead(waker: Waker, routes: RouteTable, pool: Pool, app: App, machine_id: str) -> asyncio.Future[Any] | None:
    """Begin the machine's resume for a request sent ahead of it (None: not this way)."""
    entry = routes.entry(machine_id)
    if entry is None or entry.state not in ("suspended", "suspending") or machine_id in waker.starting:
        return None
    if not pool.has_idle(pool.address(entry, machine_port(app, entry))):
        return None  # no connection open from before it was frozen: its resume must show it listens first
    waking = waker.begin(app.name, machine_id, ahead=True)
    waking.add_done_callback(_mark_retrieved)
    return waking


async def resumed(ex: Exchange) -> None:
    """Wait for the resume the request went ahead of; `ResumeFailed` if it failed."""
    waking = ex.waking
    assert waking is not None
    ex.waking = None
    try:
        await asyncio.shield(waking)
    except WakeError as exc:
        raise ResumeFailed(str(exc)) from None


async def head_once_resumed(ex: Exchange, conn: Conn) -> bytes:
    """The response head of a request sent ahead of its machine's resume (`resume_ahead`); `ResumeFailed`
    if the resume fails first (the machine stays frozen and would never answer)."""
    waking = ex.waking
    assert waking is not None
    head = asyncio.ensure_future(conn.reader.readuntil(b"\r\n\r\n"))
    try:
        await asyncio.wait((head, waking), return_when=asyncio.FIRST_COMPLETED)
        if waking.done():
            failure = asyncio.CancelledError() if waking.cancelled() else waking.exception()
            if failure is not None and not (head.done() and head.exception() is None):
                raise ResumeFailed(str(failure) or "the resume was cancelled")
            ex.waking = None  # resumed: what follows is an ordinary exchange
        return await head
    finally:
        head.cancel()


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    """A resume run ahead of its request: its failure is the request's (`head_once_resumed`), never logged
    by asyncio as unretrieved when the answer came first."""
    if not future.cancelled():
        future.exception()
