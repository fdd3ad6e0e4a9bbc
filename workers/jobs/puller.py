"""Late binding and backpressure in one: pull requests on the region's work queue, never more
outstanding than this worker's free slots.

A worker asks the queue's consumer for `batch = free slots - running - already asked for` messages,
each pull request on a reply subject of its own (`<inbox>.<n>`), so the status that ends a request
(408 expired, 409) says which one ended; messages fill the requests in the order they were made. A
message is bound to this worker only when it arrives, and it arrives only because a slot was free: no
worker holds a queue of its own, so a job never waits behind another on a busy worker while an idle one
is free. A full worker asks for nothing. A slot is free again as soon as its job's process has ended
(`handle` is given a `release`), not once the outcome is written: the next job is asked for meanwhile.
While a request is open, freed slots are asked for together once half the slots are free (one pull
request for several jobs), not one request per freed slot.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from bus.transport.nats_adapter import Nats

HAND_BACK_TIMEOUT = 0.5  # seconds a stopping worker gives one nak
REFUSED_BACKOFF = 1.0  # seconds before asking again after a pull request was refused
LOOK_EVERY = 0.5  # seconds between top-ups when nothing wakes the loop
log = logging.getLogger(__name__)

STATUS = "Status"


class Puller:
    def __init__(
        self,
        nc: Nats,
        stream: str,
        consumer: str,
        *,
        slots: Callable[[], int],
        handle: Callable[[Any, Callable[[], None]], Coroutine[Any, Any, None]],
        expires: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.slots = slots
        self.handle = handle
        self.expires = expires
        self.clock = clock
        self.inbox = ""
        self.requests: dict[str, tuple[int, float]] = {}  # request -> (messages still due, asked at)
        self.in_flight = 0
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._quiet_until = 0.0  # after a refused pull request, ask again only then
        self._tasks: set[asyncio.Task[Any]] = set()
        self._sub: Any = None
        self._loop: asyncio.Task[None] | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._stopping = False

    @property
    def outstanding(self) -> int:
        return sum(due for due, _ in self.requests.values())

    async def start(self) -> None:
        self.inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_message)
        self._loop = asyncio.create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        """Top up whenever woken (a message done, a request ended), and at least every `LOOK_EVERY` (to drop
        requests whose end never came): one timer for the loop, not one per wake."""
        self._tick()
        try:
            while True:
                try:
                    await self._top_up()
                except Exception:
                    log.debug("pull request not sent", exc_info=True)
                self._wake.clear()
                await self._wake.wait()
        finally:
            if self._ticker is not None:
                self._ticker.cancel()

    def _tick(self) -> None:
        self._wake.set()
        self._ticker = asyncio.get_running_loop().call_later(LOOK_EVERY, self._tick)

    async def _top_up(self) -> None:
        now = self.clock()
        for request, (_, asked_at) in list(self.requests.items()):
            if now - asked_at > self.expires + 1.0:  # its end never came (a reconnect): stop counting it
                self.requests.pop(request, None)
        slots = self.slots()
        want = slots - self.in_flight - self.outstanding
        if want <= 0 or not self.nc.is_connected or now < self._quiet_until:
            return
        if self.outstanding and want < (slots + 1) // 2:
            # a request is still open (a job arriving now is taken at once): the slots freed since are asked for
            # together, once half are free, not one pull request each (in a burst: 0.7 requests per job)
            return
        request = str(next(self._ids))
        self.requests[request] = (want, now)
        body = {"batch": want, "expires": int(self.expires * 1e9)}
        await self.nc.publish(self.next_subject, json.dumps(body).encode(), reply=f"{self.inbox}.{request}")

    async def _on_message(self, msg: Any) -> None:
        status = (msg.headers or {}).get(STATUS)
        if self._stopping and msg.data:  # a job for a pull request made before the stop: back to the queue now
            await hand_back(msg)
            return
        if status is not None and not msg.data:
            if status != "100":  # 408 expired, 409 and the like: this request (named by the subject) is over
                self.requests.pop(msg.subject.rsplit(".", 1)[-1], None)
                if status == "408":  # it expired as asked: ask again at once
                    self._wake.set()
                else:  # refused (503: the queue's stream out of reach, as in a region cut): not in a tight loop
                    self._quiet_until = self.clock() + REFUSED_BACKOFF
            return
        # a job message carries its own subject, not the request's: the server answers pull requests in the
        # order they came, so it is the oldest open request's
        oldest = next(iter(self.requests), None)
        if oldest is not None:
            due, asked_at = self.requests[oldest]
            if due <= 1:
                del self.requests[oldest]
            else:
                self.requests[oldest] = (due - 1, asked_at)
        self.in_flight += 1
        held = [True]

        def release() -> None:
            """The slot is free again: the job's process ended (its outcome may still be being written)."""
            if held[0]:
                held[0] = False
                self.in_flight -= 1
                self._wake.set()

        task: asyncio.Task[None] = asyncio.create_task(self.handle(msg, release))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: release())

    def stop_asking(self) -> None:
        """Ask the queue for nothing more; a job still arriving for an earlier pull request goes back at once."""
        self._stopping = True
        if self._loop is not None:
            self._loop.cancel()

    async def close(self) -> None:
        """Stop asking; attempts running here are left to end (their machines destroy themselves). A job pulled but
        not started goes back to the queue at once (`handle` is cancelled before its attempt began: it naks)."""
        self.stop_asking()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)
        if self._sub is not None:  # last: a job arriving meanwhile was handed back, not left for the ack wait
            try:
                await self._sub.unsubscribe()
            except Exception:
                log.debug("unsubscribe failed", exc_info=True)


async def hand_back(msg: Any) -> None:
    """Give a job message back to the queue at once (a nak without delay): this worker will not run it."""
    try:
        await asyncio.wait_for(msg.nak(), HAND_BACK_TIMEOUT)
    except Exception:
        log.debug("nak failed (the ack wait will give it back)", exc_info=True)
