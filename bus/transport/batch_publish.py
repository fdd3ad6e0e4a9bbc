"""Publishing a batch to JetStream and collecting its acks through one subscription: the worker outbox's wire.

It lives in the bus beside `jsfast` (one request at a time), whose ack it decodes; the op log (`workers.log`)
keeps what is published and when, not how.

The outbox sends rounds: a batch published at once, the acks awaited together with one deadline.
nats-py's `publish_async` would give each message a future with a done callback, a semaphore slot, a
fresh NUID, and parse its ack with `json.loads` into a dataclass; for the outbox that was about as
much CPU as the publish itself. A round needs none of it: one reply subscription for the life of the
connection (nats-py renews it after a reconnect), reply subjects `<inbox>.<n>` with `n` counting up (so
an ack arriving after its round gave up matches nothing and changes nothing), the outcomes of the round
in a list, and one future resolved by the last ack.

An outcome is None only for a JetStream ack without an error (a duplicate dropped by `Nats-Msg-Id` is
one); an error reply, a status reply (503: no stream takes the subject), an undecodable reply or no
reply within the deadline is an exception, and the caller sends that message again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.transport.jsfast import PubAck, ReplyInbox

Message = tuple[str, bytes, dict[str, str] | None]  # subject, payload, headers
OnAck = Callable[[int, "BaseException | None"], None]  # a message's index in the round, and its outcome
STATUS_HEADER = "Status"
DESCRIPTION_HEADER = "Description"


class Refused(Exception):
    """JetStream answered, and did not store the message."""


_decode_ack = msgspec.json.Decoder(PubAck).decode  # the ack jsfast reads: one shape for both


class BatchPublisher:
    """`send(messages)` publishes them all, then waits (up to `timeout`) for their acks together.

    One round at a time: the outbox's single delivery task is the only caller.
    """

    def __init__(self, nc: Client, *, timeout: float) -> None:
        self.timeout = timeout
        self._inbox = ReplyInbox(nc, self._on_ack)  # subscribed on the first round
        self._waiting: dict[str, int] = {}  # reply token -> index in the round
        self._outcomes: list[BaseException | None] = []
        self._left = 0
        self._done: asyncio.Future[None] | None = None
        self._on_each: OnAck | None = None

    async def send(self, messages: Sequence[Message], on_ack: OnAck | None = None) -> list[BaseException | None]:
        """Per message, None (stored) or why not, in the order given. `on_ack(i, outcome)` is called as each
        answer comes (a message's ack need not wait for the round's slowest: an fsync'd stream's)."""
        if not messages:
            return []
        self._on_each = on_ack
        await self._inbox.start()
        loop = asyncio.get_running_loop()
        done = self._done = loop.create_future()
        outcomes = self._outcomes = [None] * len(messages)
        waiting = self._waiting = {}
        self._left = len(messages)
        try:
            for i, (subject, payload, headers) in enumerate(messages):
                token = self._inbox.token()
                waiting[token] = i
                await self._inbox.publish(subject, payload, token, headers)
        except Exception as exc:  # could not even be queued (connection closed): this round failed
            waiting.clear()
            return [exc] * len(messages)
        deadline = loop.call_later(self.timeout, _resolve, done)
        try:
            await done
        finally:
            deadline.cancel()
        late = TimeoutError(f"no ack within {self.timeout:g}s")
        for i in waiting.values():
            outcomes[i] = late
        waiting.clear()  # acks still on their way are now late: they match nothing
        return outcomes

    def _on_ack(self, token: str, msg: Msg) -> None:
        index = self._waiting.pop(token, None)
        if index is None:
            return  # its round is over (it gave up, or failed to publish)
        outcome = self._outcomes[index] = _outcome(msg)
        if self._on_each is not None:
            self._on_each(index, outcome)
        self._left -= 1
        if self._left == 0 and self._done is not None:
            _resolve(self._done)


def _outcome(msg: Msg) -> BaseException | None:
    headers = msg.headers
    if headers and STATUS_HEADER in headers:  # no stream takes the subject (503), or another status
        return Refused(f"status {headers[STATUS_HEADER]} {headers.get(DESCRIPTION_HEADER, '')}".strip())
    try:
        ack = _decode_ack(msg.data)
    except msgspec.DecodeError as exc:
        return Refused(f"undecodable ack: {exc}")
    if ack.error is not None:
        return Refused(f"{ack.error.code} {ack.error.description}")
    return None


def _resolve(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


Round = Callable[[], Awaitable[tuple[int, BaseException | str | None]]]  # a round: delivered, first failure


async def deliver_rounds(
    nc: Client,
    *,
    ready: Callable[[], bool],
    wake: asyncio.Event,
    send_round: Round,
    failing: Callable[[BaseException | str], None],
    recovered: Callable[[], None],
    retry_min: float,
    retry_max: float,
) -> None:
    """Send rounds for ever: one whenever `ready()` (else wait for `wake`), none while `nc` is not connected. A
    round that failed and delivered nothing is sent again after a backoff from `retry_min` doubling to
    `retry_max`; one that delivered anything goes on at once. `failing(error)` and `recovered()` are told each
    round's outcome (the callers say it once in their logs). The worker's outboxes (the events and index entries,
    the audit records) share this loop."""
    delay = retry_min
    while True:
        if not ready():
            wake.clear()
            await wake.wait()
            continue
        delivered, error = (0, "not connected to NATS") if not nc.is_connected else await send_round()
        if error is None:
            recovered()
        else:
            failing(error)
        if error is None or delivered:
            delay = retry_min
            continue
        await asyncio.sleep(delay)
        delay = min(delay * 2, retry_max)
