"""Requests in flight when the connection drops end at once, as "no answer: it may have arrived".

nats-py keeps a request's reply future across a reconnect: when the server a client was connected to dies
(kill -9, a host gone), every request sent through it waits out its whole timeout (30 s for a create) although
its reply can no longer come the way it was asked for. A person at the CLI sees a frozen command; a retry loop
with an idempotency key loses half a minute per lost request. So the moment nats-py reports the disconnect,
every reply still awaited on this connection fails with `RequestLost`: nats-py's own requests (its JetStream
and KV calls included) and those of `FastJetStream`, which keeps its own waiters and registers them here.

`RequestLost` is a nats-py `TimeoutError`: every caller already treats a timeout as an unknown outcome (the
request may have arrived and acted), and this is one, only known sooner. Requests made while disconnected are
left alone: nats-py buffers them and sends them once it has reconnected.

The trade: a slow responder (a `stop` that waits 10 s for its machine) that answers after this connection has
reconnected elsewhere would have been heard, and is not. That is what an HTTP client does when its connection
drops, and what a person at the CLI expects: the command says at once that the answer was lost, and a get (or
a create with the same idempotency key) finds out what happened. A create, the path this guards, answers in
milliseconds, long before a reconnect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from bus.transport.nats_adapter import Connection, Nats, errors, pending_replies

BROKE = "the connection to NATS broke on the way (it may have arrived)"  # how an error reply says it


class RequestLost(errors.TimeoutError):
    """The connection broke while this request awaited its reply: it may have arrived."""

    def __str__(self) -> str:
        return "nats: the connection broke while the request awaited its reply (it may have arrived)"


def lost(exc: BaseException) -> bool:
    """Whether a nats-py timeout was a `RequestLost`: nats-py raises its own `TimeoutError` in place of the
    one its wait ended with, so the lost request is that one's context."""
    return isinstance(exc, RequestLost) or isinstance(exc.__context__, RequestLost)


def on_disconnect(client: Nats, fail: Callable[[], None]) -> None:
    """Call `fail` whenever `client` loses its connection (a component's own waiters, e.g. `FastJetStream`'s).
    Only our `Connection` reports its drops (`connect` makes them); a plain nats-py client never calls it."""
    if isinstance(client, Connection):
        client.disconnect_hooks.append(fail)


def when_disconnected(client: Connection) -> Callable[[], Awaitable[None]]:
    """nats-py's `disconnected_cb` for `client`: fail what it awaits."""

    async def disconnected() -> None:
        fail_waiting(client)

    return disconnected


def fail_waiting(client: Connection) -> None:
    """Fail every reply `client` still awaits. nats-py's are private to it (`nats_adapter.pending_replies`): if a
    later nats-py moves them, `tests/bus/test_nats_adapter.py` says so."""
    for future in list(pending_replies(client).values()):
        if not future.done():
            future.set_exception(RequestLost())
    for fail in client.disconnect_hooks:
        fail()
