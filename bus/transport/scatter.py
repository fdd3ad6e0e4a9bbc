"""Scatter-gather over NATS: publish one request, collect many replies until enough or a deadline.

nats-py's `request` returns the first reply only. Auctions need every worker's answer, so this
opens one wildcard inbox subscription per connection and gives each scatter a fresh reply subject
under it. Gathering stops as soon as `expected` replies are in, or at the deadline, whichever comes
first; a slow or dead responder delays a scatter by at most the deadline and never blocks another.
Replies that fail to decode are counted and dropped, never raised.

Silence is not an answer: a scatter given `patience` that has heard nobody at its deadline waits on for the
first reply, until `patience` has passed since it was sent. Responders that answer in a millisecond never see the
difference; a host so busy that every responder missed the deadline (a CPU stall, a parallel test run) gets its
auction held a little longer rather than a "nobody answered" that would read as a refusal (CI34: a create at four
test files a time failed with "no capacity ... no answer within deadline" from a region of two live, idle workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.contract.codec import encode

T = TypeVar("T")


class Gathered(Generic[T]):
    """What a scatter brought back, with timing for explain output and benchmarks."""

    __slots__ = ("elapsed", "malformed", "replies", "timed_out")

    def __init__(self, replies: list[T], malformed: int, timed_out: bool, elapsed: float) -> None:
        self.replies = replies
        self.malformed = malformed
        self.timed_out = timed_out
        self.elapsed = elapsed

    def __repr__(self) -> str:
        return (
            f"Gathered({len(self.replies)} replies, malformed={self.malformed}, "
            f"timed_out={self.timed_out}, elapsed={self.elapsed * 1000:.2f}ms)"
        )


class _Collector:
    __slots__ = ("done", "expected", "first", "malformed", "parse", "replies")

    def __init__(self, expected: int | None, parse: Callable[[bytes], Any]) -> None:
        self.expected = expected
        self.parse = parse
        self.replies: list[Any] = []
        self.malformed = 0
        self.done = asyncio.Event()
        self.first = asyncio.Event()  # some reply came, decoded or not


class Scatterer:
    """One per connection: a shared inbox subscription, a fresh reply subject per scatter."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._sub: Any = None
        self._collectors: dict[str, _Collector] = {}
        self._counter = 0

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._on_reply)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _on_reply(self, msg: Msg) -> None:
        collector = self._collectors.get(msg.subject)
        if collector is None:
            return  # a late reply to a finished scatter
        try:
            collector.replies.append(collector.parse(msg.data))
        except Exception:
            collector.malformed += 1
        collector.first.set()
        if collector.expected is not None and len(collector.replies) + collector.malformed >= collector.expected:
            collector.done.set()

    async def scatter(
        self,
        subject: str,
        payload: Any,
        parse: Callable[[bytes], T],
        *,
        expected: int | None,
        deadline: float,
        patience: float | None = None,
    ) -> Gathered[T]:
        """Publish `payload` on `subject`; gather parsed replies until `expected` arrive or `deadline` s pass.
        `patience` (> `deadline`): with no reply at the deadline, wait for the first one until `patience` s have
        passed since the publish, then return what came (see the top)."""
        await self.start()
        started = time.perf_counter()
        self._counter += 1
        reply = f"{self._prefix}.{self._counter}"
        collector = _Collector(expected, parse)
        self._collectors[reply] = collector
        timed_out = False
        try:
            data = payload if isinstance(payload, bytes) else encode(payload)
            await self._nc.publish(subject, data, reply=reply)
            if expected == 0:
                pass
            else:
                try:
                    await asyncio.wait_for(collector.done.wait(), timeout=deadline)
                except TimeoutError:
                    timed_out = True
                if timed_out and patience is not None and not collector.first.is_set():
                    left = patience - (time.perf_counter() - started)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(collector.first.wait(), timeout=max(0.0, left))
        finally:
            del self._collectors[reply]
        return Gathered(list(collector.replies), collector.malformed, timed_out, time.perf_counter() - started)
