"""Keeps the view current: the events stream through an ordered consumer, heartbeats through a KV watch.

It only writes, through `fold.ViewWriter`; what `status` shows is read through `query.ViewReader`.

Start-up checks that the view still matches the stream (same stream, nothing aged out in between;
otherwise the view is reset and rebuilt from what the stream holds, rather than shown stale), then
consumes from the sequence after the last one applied. Messages are queued by the subscription's
callback and applied by one task in batches, one SQLite transaction each, so a catch-up over many
thousands of events costs a few transactions, and a single live event is applied as soon as it
arrives. Heartbeats come from a watch on KV `fauxmad_workers`, whose expiry markers mark a worker lost.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from bus.contract import subjects
from bus.contract.beats import BeatGroups
from bus.contract.codec import decoder
from bus.contract.fleet import WorkerInfo
from bus.contract.machines import MachineEvent
from bus.transport.connection import connect
from bus.transport.jetstream import ensure_fleet_resources
from bus.transport.nats_adapter import ConsumerConfig, DeliverPolicy, Msg, Nats
from orchestrator.replicas.replica import KVReplica
from orchestrator.view.db import ViewDb
from orchestrator.view.fold import ViewWriter, needs_rebuild
from orchestrator.view.query import ViewReader

log = logging.getLogger(__name__)

BATCH_MAX = 2000


def decode_event(data: bytes) -> MachineEvent | None:
    """An event from the stream, or None for anything else (the view skips it and moves on)."""
    try:
        event: MachineEvent = decoder(MachineEvent).decode(data)
    except Exception:
        log.debug("view: skipping a message that is not an event: %r", data[:200])
        return None
    return event if event.machine_id and event.worker_id and event.app else None


class WorkerMirror(KVReplica):
    """KV `fauxmad_workers` into the view's `workers` table (`None`: the key expired or was deleted).

    Heartbeats wake nobody: every worker beats every second, and a screen that follows the view redraws
    on its own tick anyway; only events are worth an immediate redraw.
    """

    def __init__(self, view: ViewWriter, clock: Callable[[], float]) -> None:
        super().__init__()
        self.view = view
        self.clock = clock
        self.keys: set[str] = set()
        self._groups = BeatGroups()  # a process's logical workers beat under one key: one update per worker

    def expand(self, key: str, value: bytes | None) -> list[tuple[str, bytes | None]]:
        return self._groups.updates(key, value)

    def apply(self, key: str, value: bytes | None) -> None:
        info: WorkerInfo | None = None
        if value is not None:
            try:
                info = decoder(WorkerInfo).decode(value)
            except Exception:
                log.warning("view: ignoring a malformed heartbeat under %s", key)
                return
            self.keys.add(key)
        else:
            self.keys.discard(key)
        self.view.put_heartbeat(key, info, self.clock())


class ViewFollower:
    def __init__(
        self,
        nc: Nats,
        view: ViewWriter,
        *,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        batch_max: int = BATCH_MAX,
    ) -> None:
        self.nc = nc
        self.view = view
        self.on_change = on_change
        self.clock = clock
        self.batch_max = batch_max
        self.position = 0  # the stream sequence applied last
        self.applied = 0  # events applied by this follower (resume tests count these)
        self.first_applied: int | None = None  # the first stream sequence this follower applied
        self.rebuilt: str | None = None  # why start-up reset the view, if it did
        self._pending: collections.deque[tuple[int, bytes]] = collections.deque()
        self._wake = asyncio.Event()
        self._moved = asyncio.Event()
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._mirror = WorkerMirror(view, clock)

    async def start(self, *, heartbeats: bool = True) -> None:
        """Check the view against the stream, follow events from where it left off, and mirror heartbeats."""
        js = self.nc.jetstream()
        fleet = await ensure_fleet_resources(js)
        info = await js.stream_info(subjects.EVENTS_STREAM)
        created = info.created.isoformat() if info.created else ""
        self.rebuilt = needs_rebuild(self.view.identity(), info.state.first_seq, info.state.last_seq, created)
        if self.rebuilt:
            log.info("view %s: rebuilding: %s", self.view.db.path, self.rebuilt)
            self.view.reset()
        self.view.bind_stream(created, info.state.first_seq)
        self.position = self.view.db.last_seq
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        if self.position:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.position + 1)
        self._task = asyncio.create_task(self._apply_loop())
        self._sub = await js.subscribe(
            subjects.EVENTS_ALL, stream=subjects.EVENTS_STREAM, cb=self._on_msg, ordered_consumer=True, config=config
        )
        if heartbeats:
            await self._mirror.start(fleet.workers)
            self.view.lost_unless(self._mirror.keys, self.clock())

    async def _on_msg(self, msg: Msg) -> None:
        try:
            stream_seq = msg.metadata.sequence.stream
        except Exception:
            return
        self._pending.append((stream_seq, msg.data))
        self._wake.set()

    async def _apply_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                count = min(len(self._pending), self.batch_max)
                batch = [self._pending.popleft() for _ in range(count)]
                try:
                    applied = self.view.apply_events([(seq, decode_event(data)) for seq, data in batch])
                except Exception:
                    log.exception("view: could not apply %d events; they will be read again", count)
                    self._pending.extendleft(reversed(batch))
                    await asyncio.sleep(0.5)
                    continue
                if applied and self.first_applied is None:
                    self.first_applied = next(seq for seq, _ in batch if seq > self.position)
                self.applied += applied
                self.position = max(self.position, batch[-1][0])
                self._moved.set()
                self.on_change()
                await asyncio.sleep(0)  # let the subscription deliver more before the next batch

    async def stream_last_seq(self) -> int:
        info = await self.nc.jetstream().stream_info(subjects.EVENTS_STREAM)
        return int(info.state.last_seq)

    async def catch_up(self, timeout: float) -> bool:
        """Wait until every event the stream holds now is applied (False if `timeout` passes first)."""
        target = await self.stream_last_seq()
        deadline = time.monotonic() + timeout
        while self.position < target:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), min(remaining, 0.5))
        return True

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self._mirror.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


@contextlib.asynccontextmanager
async def followed(
    url: str,
    path: Path,
    *,
    name: str,
    rebuild: bool = False,
    on_change: Callable[[], None] = lambda: None,
    reconnect_forever: bool = False,
) -> AsyncIterator[tuple[ViewFollower, ViewReader]]:
    """The view in file `path`, followed from the fleet at `url` while the block runs (`rebuild`: emptied
    first); yields the follower (how far it got) and a reader of the same file. Closes all it opened.
    `reconnect_forever` (`status --watch`): once connected, ride out a nats-server restart."""
    nc = await connect(url, name, reconnect_forever=reconnect_forever)
    db = ViewDb(path)
    writer = ViewWriter(db)
    follower = ViewFollower(nc, writer, on_change=on_change)
    try:
        if rebuild:
            writer.reset()
        await follower.start()
        yield follower, ViewReader(db)
    finally:
        await follower.close()
        db.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2.0)
