"""One logical KV bucket kept as a bucket per region (a supercluster's layout, `bus.transport.layout`).

Readers keep seeing one bucket: `watchall` merges the regions' watches (a replica in a broker or a
reconciler follows every region's heartbeats and routing index, as it follows the one bucket on a single
server), `get` asks the caller's own region first and then the others. Writers put into one region's
bucket: a key that starts with a region (`<region>.<worker_id>`, the heartbeats) goes to that region's,
any other key to the caller's own region.

Why per-region reads rather than one fleet-wide copy (stream sources into a bucket in some region): a copy
lives in one region, so that region's outage would blind every other region, and a copy of a bucket whose
keys expire cannot tell "this region went quiet" from "the copy stopped being fed". Reading each region
where it lives keeps a region's view of itself independent of the others, and a region that does not
answer is known to be unreachable rather than taken for empty.

A region unreachable when a watch starts is watched as soon as it answers (tried again every few
seconds); meanwhile the merged watch reports its initial values as in without it: at once when its watch could
not even be made (it refused, or did not answer), or it did not answer this process's start, and another region's
initial values are in; else after the initial timeout. A broker restarted in a region about to be cut off
otherwise spent 4 s a watch on regions it could not reach before serving its own (the nemesis on hosts, seed
105). When no region answers, the watch waits on (up to `NONE_ANSWERED_LIMIT`) for the first: that is
JetStream pausing, not a region out. nats-py's ordered consumers recreate themselves after a partition heals,
so a running watch resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

log = logging.getLogger(__name__)

RETRY_WATCH = 3.0
NONE_ANSWERED_LIMIT = 20.0  # seconds a watch waits for its first region's initial values when none answered


class MergedWatch:
    """The entries of every region's watch, as one async iterator; one `None` once the initial values are in."""

    def __init__(
        self, buckets: Mapping[str, KeyValue], initial_timeout: float, unanswered: frozenset[str] = frozenset()
    ) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._pending = set(buckets)
        self._unread = set(buckets)  # regions whose initial values never came (`unread`)
        # regions whose watch could not be made yet; at first, those that did not answer this process's start
        self._failed: set[str] = set(unanswered) & self._pending
        self._first_answered = asyncio.Event()
        self._initial_timeout = initial_timeout
        self._watchers: dict[str, Any] = {}
        self._tasks = [asyncio.create_task(self._follow(region, kv)) for region, kv in buckets.items()]
        self._timer = asyncio.create_task(self._initial_deadline())
        self._stopped = False

    async def _initial_deadline(self) -> None:
        await asyncio.sleep(self._initial_timeout)
        # no region at all answered yet: that is JetStream itself pausing (its meta leader, which every new
        # watch needs, being elected again after its server died: 4 to 9 s), not one region out; an empty
        # view would read as "no workers anywhere", so wait on for the first region (bounded)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_answered.wait(), NONE_ANSWERED_LIMIT - self._initial_timeout)
        if self._pending:
            log.warning(
                "regions %s did not answer: following them as soon as they do", ", ".join(sorted(self._pending))
            )
            self._pending.clear()
            self._queue.put_nowait(None)

    def unread(self) -> frozenset[str]:
        """The regions whose values this watch has never read: they did not answer yet (their watch is tried again
        every few seconds). Not to be taken for regions without keys."""
        return frozenset(self._unread)

    def _initial_done(self, region: str) -> None:
        self._unread.discard(region)
        if region in self._pending:
            self._first_answered.set()
            self._pending.discard(region)
            self._unless_pending()

    def _unless_pending(self) -> None:
        """The initial values are in once every region still pending is one whose watch could not be made."""
        if self._pending and (not self._first_answered.is_set() or not self._pending <= self._failed):
            return
        if self._pending:
            log.warning("regions %s do not answer: following them as soon as they do", ", ".join(sorted(self._pending)))
            self._pending.clear()
        self._timer.cancel()
        self._queue.put_nowait(None)

    async def _follow(self, region: str, kv: KeyValue) -> None:
        while not self._stopped:
            try:
                watcher = self._watchers[region] = await kv.watchall()
                self._failed.discard(region)
                async for entry in watcher:
                    if entry is None:
                        self._initial_done(region)
                    else:
                        self._queue.put_nowait(entry)
                return  # stopped
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("watch of region %s: %r; trying again in %gs", region, exc, RETRY_WATCH)
                if region in self._pending:
                    self._failed.add(region)
                    self._unless_pending()
                await asyncio.sleep(RETRY_WATCH)

    def __aiter__(self) -> MergedWatch:
        return self

    async def __anext__(self) -> Any:
        if self._stopped:
            raise StopAsyncIteration
        return await self._queue.get()

    async def stop(self) -> None:
        self._stopped = True
        for watcher in self._watchers.values():
            with contextlib.suppress(Exception):
                await watcher.stop()
        for task in (*self._tasks, self._timer):
            task.cancel()


class RegionalKV:
    """A bucket per region, read as one: `buckets` maps region -> bucket; `own` is the caller's region."""

    def __init__(
        self,
        buckets: Mapping[str, KeyValue],
        own: str | None = None,
        *,
        initial_timeout: float = 4.0,
        unanswered: frozenset[str] = frozenset(),
    ) -> None:
        self.buckets = dict(buckets)
        self.own = own if own in self.buckets else None
        self.initial_timeout = initial_timeout
        self.unanswered = unanswered  # regions that did not answer when this process bound them (`jetstream._regions`)

    def region(self, region: str) -> KeyValue:
        """The bucket of `region` (KeyError for a region outside the layout)."""
        return self.buckets[region]

    def _order(self) -> list[str]:
        return sorted(self.buckets, key=lambda r: (r != self.own, r))

    def _for_key(self, key: str) -> KeyValue:
        region = key.split(".", 1)[0]
        if region in self.buckets:
            return self.buckets[region]
        if self.own is None:
            raise KeyError(f"key {key!r} names no region and this process has none")
        return self.buckets[self.own]

    async def watchall(self) -> MergedWatch:
        return MergedWatch(self.buckets, self.initial_timeout, self.unanswered)

    async def get(self, key: str) -> Any:
        """The entry under `key` in whichever region holds it: this process's region first."""
        last: Exception = KeyNotFoundError()
        for region in self._order():
            try:
                return await self.buckets[region].get(key)
            except KeyNotFoundError as exc:
                last = exc
            except Exception as exc:  # that region does not answer: the key may still be in another
                log.debug("get %s in region %s: %r", key, region, exc)
                last = exc
        raise last

    async def put(self, key: str, value: bytes) -> int:
        return int(await self._for_key(key).put(key, value))
