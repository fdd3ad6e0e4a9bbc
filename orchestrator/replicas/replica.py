"""A local replica of a KV bucket, kept current by a watch: the pattern behind `workers` and `machines`.

Brokers and reconcilers answer hot-path questions (who is alive in a region, which worker owns a
machine) from memory. A watch delivers the bucket's current values, then every put and every delete
or expiry marker; subclasses say what one update means by implementing `apply`.

After the connection reconnects (a NATS server restarted), the watch is made again at once and its initial
values replace the replica's (a key missing from them was deleted or expired meanwhile). Left to itself, the
watch's ordered consumer notices the lost server only after two missed idle heartbeats, 10-15 s during which
a broker saw no live workers and an operator replaced machines of workers that were there all along.

A watch can also stall with no reconnect at all: its consumer lives on the stream's leader, and when that server
dies (or is cut off) a client connected to another server keeps its connection and hears nothing more. A replica
of a bucket that is never quiet for long (`stall_after`: the workers' heartbeats) makes its watch again when it has
heard nothing for that long. CI's nemesis on hosts: after a server kill moved the workers bucket's leader, an
operator's registry heard no heartbeat again, kept three live workers lost, and left both copies of two
replaced primaries running for the rest of the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from bus.transport.nats_adapter import Bucket, Nats, Watcher, connection_of, kv_stream

log = logging.getLogger(__name__)

RECONNECT_POLL = 0.2  # seconds between looks at the connection's reconnect count
REWATCH_RETRY = 0.5  # seconds between attempts to watch again while JetStream is still coming back


def _client_of(kv: Bucket) -> Nats | None:
    """The NATS client under a KV bucket (or under the first of a region-merged set of them)."""
    buckets = getattr(kv, "buckets", None)
    where = kv_stream(next(iter(buckets.values())) if buckets else kv)
    return connection_of(where.js) if where is not None else None


class KVReplica:
    def __init__(self, *, stall_after: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_after = stall_after  # seconds of silence after which the watch is made again (None: never)
        self._quiet_clock = clock
        self._heard_at = clock()  # when the watch last delivered anything
        self._kv: Bucket | None = None
        self._watcher: Watcher | None = None
        self._task: asyncio.Task[None] | None = None
        self._guard: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._present: set[str] = set()  # keys with a value, as far as this replica knows
        self.on_change: Callable[[str], None] | None = None  # called with the key after each update
        self._applied = 0  # the bucket's stream sequence of the last update applied here
        self._moved = asyncio.Event()  # set (and replaced) at each update: what `caught_up` waits on

    def apply(self, key: str, value: bytes | None) -> None:
        """One update; `value=None`: the key was deleted or expired."""
        raise NotImplementedError

    async def start(self, kv: Bucket, timeout: float = 5.0) -> None:
        """Watch `kv` and return once its current values are in (or after `timeout`)."""
        self._kv = kv
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow(self._watcher, None))
        client = _client_of(kv)
        if client is not None:
            self._guard = asyncio.create_task(self._rewatch_on_reconnect(client))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)

    async def _follow(self, watcher: Any, before: set[str] | None) -> None:
        """Apply what `watcher` delivers; `before`: the keys known before a re-watch, of which those missing
        from its initial values are gone."""
        seen: set[str] = set()
        async for entry in watcher:
            self._heard_at = self._quiet_clock()
            if entry is None:  # the initial values are all in
                self._ready.set()
                if before is not None:
                    for key in before - seen:
                        self._update(key, None)
                    before = None
                continue
            seen.add(entry.key)
            self._update(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
            revision = getattr(entry, "revision", None)
            if isinstance(revision, int) and revision > self._applied:
                self._applied = revision
            self._moved.set()
            self._moved = asyncio.Event()

    async def caught_up(self, within: float) -> bool:
        """Wait until every update the bucket holds now is applied here: its stream's last sequence, read now,
        then the watch reaching it; at most `within` seconds. False when it did not, or cannot be told (a
        region-merged bucket). For an answer that must not rest on a watch running behind (a proxy about to
        say an app has no machines, a moment after one was created)."""
        where = kv_stream(self._kv)
        if where is None:
            return False
        js, stream = where.js, where.stream
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        try:
            last = int((await asyncio.wait_for(js.stream_info(stream), within)).state.last_seq)
        except Exception:  # not answered in time, or JetStream away: nothing known
            return False
        while self._applied < last:
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), left)
        return True

    def expand(self, key: str, value: bytes | None) -> list[tuple[str, bytes | None]]:
        """The updates one update of the bucket means to `apply`: itself, unless the bucket's keys say more (the
        workers bucket's beat groups: `bus.contract.beats.BeatGroups`)."""
        return [(key, value)]

    def _update(self, key: str, value: bytes | None) -> None:
        if value is None:
            self._present.discard(key)
        else:
            self._present.add(key)
        for one, its in self.expand(key, value):
            self.apply(one, its)
            if self.on_change is not None:
                self.on_change(one)

    async def _rewatch_on_reconnect(self, client: Nats) -> None:
        assert self._kv is not None, "started before it guards"
        reconnects = client.stats["reconnects"]
        while True:
            await asyncio.sleep(RECONNECT_POLL)
            if not client.is_connected:
                continue
            stalled = self._stalled()
            if client.stats["reconnects"] == reconnects and not stalled:
                continue
            if stalled:
                log.info("%s: nothing heard for %.1fs: watching again", type(self).__name__, self.stall_after)
                self._heard_at = self._quiet_clock()  # one new watch per `stall_after` at most
            reconnects = client.stats["reconnects"]
            try:
                watcher = await self._kv.watchall()
            except Exception as exc:  # JetStream not back yet: try again at the next look
                log.debug("re-watch after a reconnect failed: %r", exc)
                reconnects -= 1
                await asyncio.sleep(REWATCH_RETRY)
                continue
            old_watcher, old_task = self._watcher, self._task
            self._watcher = watcher
            self._task = asyncio.create_task(self._follow(watcher, set(self._present)))
            await self._stop(old_watcher, old_task)

    def _stalled(self) -> bool:
        """Heard nothing for `stall_after` from a bucket that holds values (an empty one may well be quiet)."""
        return (
            self.stall_after is not None
            and bool(self._present)
            and self._quiet_clock() - self._heard_at > self.stall_after
        )

    async def close(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._guard
        await self._stop(self._watcher, self._task)

    @staticmethod
    async def _stop(watcher: Any, task: asyncio.Task[None] | None) -> None:
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
