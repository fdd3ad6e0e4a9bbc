"""Publishes nats-server refused, turned into an immediate 403 for whoever waits on a reply to them.

On a secure fleet the server drops a message its sender may not publish and says so only to that connection,
in an `-ERR 'Permissions Violation for Publish to "<subject>"'` that nats-py hands to the error callback. Nothing
will ever answer such a request, so a waiter that is not told waits out its whole timeout and then reports a
timeout, not a refusal. `Refusals` (one per secure connection, its `refusals`) matches each such error to the
requests waiting on its subject: nats-py's requests through our `Connection` (`bus.transport.nats_adapter`:
`guard`), and the lean JetStream requests of `bus.transport.jsfast`, whose reply futures are watched as they
are (`watch(subject, future)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from bus.contract.errors import Forbidden

T = TypeVar("T")

_PUBLISH_VIOLATION = re.compile(r"permissions violation for publish to [\"']?([^\"'\s]+)", re.IGNORECASE)

REFUSED = object()  # the result a watched future gets when the server refuses its publish


class Refusals:
    """Publishes nats-server refused (its `-ERR 'Permissions Violation for Publish to "<subject>"'`), so a
    request to a forbidden subject fails at once as a refusal (403) instead of waiting out its timeout:
    the server drops such a message and nothing else would ever answer. Attached to secure connections,
    whose every request (the API's, and nats-py's own JetStream and KV requests: `Connection.request`) goes
    through `guard`, and whose lean JetStream requests (`bus.transport.jsfast`) watch their reply's future."""

    def __init__(self, identity: str = "") -> None:
        self.identity = identity
        self._waiting: dict[str, list[asyncio.Future[Any]]] = {}

    def watch(self, subject: str, future: asyncio.Future[Any] | None = None) -> asyncio.Future[Any]:
        """`future` (or a new one) gets the result `REFUSED` when the server refuses a publish to `subject`;
        `forget` it once its request is over."""
        if future is None:
            future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(subject.lower(), []).append(future)
        return future

    def forget(self, subject: str, future: asyncio.Future[Any]) -> None:
        key = subject.lower()
        waiting = self._waiting.get(key, [])
        if future in waiting:
            waiting.remove(future)
        if not waiting:
            self._waiting.pop(key, None)

    def noted(self, error: Exception) -> None:
        # nats-py hands the server's -ERR over in lower case, so requests are matched by their subject in lower
        # case: requests to two subjects that differ only in case, one of them refused, would both be refused
        match = _PUBLISH_VIOLATION.search(str(error))
        if match is None:
            return
        for future in self._waiting.pop(match.group(1).lower(), []):
            if not future.done():
                future.set_result(REFUSED)

    def forbidden(self, subject: str) -> Forbidden:
        """The refusal of a publish to `subject`, naming who was refused and where (one line)."""
        who = f"identity {self.identity}" if self.identity else "this identity"
        return Forbidden(f"{who} may not publish to {subject}: not allowed by its permissions (nats-server refused it)")

    async def guard(self, subject: str, asking: Awaitable[T]) -> T:
        """`asking`'s result (a request published to `subject`), or `Forbidden` the moment the server refuses
        that publish (`asking` is cancelled then)."""
        refused = self.watch(subject)
        asked: asyncio.Future[T] = asyncio.ensure_future(asking)
        try:
            either: set[asyncio.Future[Any]] = {asked, refused}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            asked.cancel()
            raise
        finally:
            self.forget(subject, refused)
        if asked.done():
            return asked.result()
        asked.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asked
        raise self.forbidden(subject)
