"""What keeps the console live: one view of the fleet per API process, and one NATS subscription per page stream.

The view (`orchestrator.view`) is followed into an in-memory SQLite file by one ordered consumer on the events
stream and one watch on the heartbeats: every page's first paint reads it, none asks the workers. It keeps current
state only (no row per event: no page lists the view's events, a machine's timeline comes from its worker), so a
long-running API's memory grows with the machines, not with every event; at start it reads the stream once.
A worker's use is sampled from it every `SAMPLE_EVERY` seconds into a short history (the heatmap), and each sample
wakes the open streams once (`ticks`), so worker bars move without a timer per page.

A page's event stream (`/ui/stream`) subscribes to exactly what the page shows (an app's or a machine's events,
its log lines, job events, its release keys), each an ordered consumer of the stream that keeps them, from new
messages on (a consumer, not a core subscription: the read side every role of a secure fleet is allowed), and
hands each message to the page as a server-sent event as it arrives: no polling loop anywhere.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from bus.transport.nats_adapter import ConsumerConfig, DeliverPolicy, Msg, Nats
from orchestrator.view.db import ViewDb
from orchestrator.view.fold import ViewWriter
from orchestrator.view.follower import ViewFollower
from orchestrator.view.model import Snapshot, WorkerRow
from orchestrator.view.query import ViewReader

log = logging.getLogger(__name__)

SAMPLE_EVERY = 2.0  # seconds between two samples of every worker's use
HISTORY = 300  # samples kept: ten minutes
QUEUE_MAX = 2000  # messages a slow page may fall behind by before it is told to reload


class Sample(msgspec.Struct, frozen=True):
    at: float
    cpu: dict[str, float]  # worker id -> share of its cpus in use (0..1)
    memory: dict[str, float]


class Live:
    def __init__(self, nc: Nats) -> None:
        self.nc = nc
        self.db = ViewDb(":memory:")
        self.reader = ViewReader(self.db)
        self.follower = ViewFollower(nc, ViewWriter(self.db, history=False))  # current state only: no row per event
        self.history: collections.deque[Sample] = collections.deque(maxlen=HISTORY)
        self._tick = asyncio.Event()
        self._sampler: asyncio.Task[None] | None = None
        self.broken = ""  # why the view could not be followed ("" when it is): the pages say so

    async def start(self) -> None:
        """Follow the fleet; a failure (a secure fleet's identity that may not read the events) is kept and shown,
        not raised: the API serves on without its console's view."""
        try:
            await self.follower.start()
        except Exception as exc:
            self.broken = f"the console cannot follow the fleet's events: {exc or type(exc).__name__}"
            log.warning("%s", self.broken)
        self._sampler = asyncio.create_task(self._sample_forever())

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        await self.follower.close()
        self.db.close()

    def snapshot(self, *, app: str | None = None, events: int = 0, include_destroyed: bool = False) -> Snapshot:
        return self.reader.snapshot(time.time(), app=app, events=events, include_destroyed=include_destroyed)

    def workers(self) -> list[WorkerRow]:
        return self.reader.snapshot(time.time(), events=0, machines=False).workers

    def sample(self) -> Sample:
        cpu, memory = {}, {}
        for w in self.workers():
            if w.status == "lost":
                continue
            cpu[w.worker_id] = w.used.cpus / w.capacity.cpus if w.capacity.cpus else 0.0
            memory[w.worker_id] = w.used.memory_mb / w.capacity.memory_mb if w.capacity.memory_mb else 0.0
        return Sample(at=time.time(), cpu=cpu, memory=memory)

    async def _sample_forever(self) -> None:
        while True:
            self.history.append(self.sample())
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()
            await asyncio.sleep(SAMPLE_EVERY)

    async def next_tick(self) -> None:
        await self._tick.wait()

    @contextlib.asynccontextmanager
    async def subscribed(self, wanted: dict[str, tuple[str, str]]) -> AsyncIterator[asyncio.Queue[tuple[str, bytes]]]:
        """A queue of `(kind, data)` for each new message on the `(stream, subject)` `wanted` maps kinds to, while
        the block runs; a queue that overflows gets `("reload", b"")` and no more. A stream that cannot be read
        (none yet, or not allowed) is left out: its kind sends nothing."""
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(QUEUE_MAX)
        subs: list[Any] = []

        def handler(kind: str) -> Any:
            async def on_msg(msg: Msg) -> None:
                if queue.full():
                    return
                queue.put_nowait((kind, msg.data) if queue.qsize() < QUEUE_MAX - 1 else ("reload", b""))

            return on_msg

        js = self.nc.jetstream()
        try:
            for kind, (stream, subject) in wanted.items():
                config = ConsumerConfig(deliver_policy=DeliverPolicy.NEW)  # one each: nats-py writes its filter in
                try:
                    subs.append(
                        await js.subscribe(
                            subject, stream=stream, cb=handler(kind), ordered_consumer=True, config=config
                        )
                    )
                except Exception as exc:
                    log.info("console: no %s messages for this page (%s): %s", kind, stream, exc)
            yield queue
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
