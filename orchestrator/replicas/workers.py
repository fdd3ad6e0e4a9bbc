"""The live-worker registry: a local replica of KV `fauxmad_workers`, kept current by a watch.

Brokers need to know, per region, which workers are alive (to know how many offers to wait for,
and whom p2c may sample) without asking anyone on the hot path. A KV watch delivers every
heartbeat and every expiry marker; a worker whose last heartbeat is older than the bucket TTL is
treated as gone even before its marker arrives. Time is injected, so staleness is testable.
Reconcilers read the same replica to know whose machines to ask for and whose are lost.

A reconciler may also `suspect` a worker it has just found silent (an edge proxy's connection was
refused and the worker itself did not answer): the worker counts as gone at once, without waiting for
its heartbeat to expire, until it proves otherwise with a heartbeat stamped after the suspicion (or
the TTL passes, by when an expired key says the same).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from bus.contract.codec import decoder
from bus.contract.fleet import WorkerInfo
from bus.transport.jetstream import WORKER_TTL
from orchestrator.replicas.replica import KVReplica

log = logging.getLogger(__name__)


class Registry(KVReplica):
    def __init__(self, *, ttl: float = WORKER_TTL, clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.ttl = ttl
        self.clock = clock
        self._workers: dict[str, WorkerInfo] = {}  # key "<region>.<worker_id>"
        self._by_region: dict[str, dict[str, WorkerInfo]] = {}
        self._seen_at: dict[str, float] = {}
        self._sorted_ids: dict[str, list[str]] = {}  # per region, for O(1) sampling; dropped when membership changes
        self._departed: asyncio.Event | None = None
        self._suspected: dict[str, float] = {}  # worker id -> when it was found silent

    def suspect(self, worker_id: str) -> None:
        """Count `worker_id` as gone from now until a heartbeat stamped later than now arrives."""
        self._suspected[worker_id] = self.clock()
        departed, self._departed = self._departed, None
        if departed is not None:
            departed.set()
        if self.on_change is not None:
            self.on_change(worker_id)

    def suspected(self, worker_id: str) -> bool:
        since = self._suspected.get(worker_id)
        if since is None:
            return False
        if self.clock() - since > self.ttl:
            del self._suspected[worker_id]
            return False
        return True

    async def departure(self) -> None:
        """Return when the next worker leaves (its key expires or is deleted)."""
        if self._departed is None:
            self._departed = asyncio.Event()
        await self._departed.wait()

    # ------------------------------------------------------------------------------------------
    def apply(self, key: str, value: bytes | None) -> None:
        """Apply one KV update (`value=None`: the key was deleted or expired)."""
        if value is None:
            info = self._workers.pop(key, None)
            self._seen_at.pop(key, None)
            if info is not None:
                self._by_region.get(info.region, {}).pop(info.worker_id, None)
                self._sorted_ids.pop(info.region, None)
            departed, self._departed = self._departed, None
            if departed is not None:
                departed.set()
        else:
            try:
                info = decoder(WorkerInfo).decode(value)
            except Exception:
                log.warning("registry: ignoring malformed heartbeat under %s", key)
                return
            if key not in self._workers:
                self._sorted_ids.pop(info.region, None)
            since = self._suspected.get(info.worker_id)
            if since is not None and info.heartbeat_at > since:
                del self._suspected[info.worker_id]  # it spoke after we found it silent
            self._workers[key] = info
            self._seen_at[key] = self.clock()
            self._by_region.setdefault(info.region, {})[info.worker_id] = info

    def _alive(self, key: str, info: WorkerInfo) -> bool:
        seen = self._seen_at.get(key, 0.0)
        if self._suspected and self.suspected(info.worker_id):
            return False
        return self.clock() - max(seen, info.heartbeat_at) <= self.ttl

    def workers(self, region: str | None = None) -> list[WorkerInfo]:
        """Live workers, optionally of one region, ordered by region then id."""
        out = [
            info
            for key, info in self._workers.items()
            if (region is None or info.region == region) and self._alive(key, info)
        ]
        out.sort(key=lambda i: (i.region, i.worker_id))
        return out

    def live_ids(self, region: str) -> set[str]:
        """The live workers of one region: O(region), no sorting (it runs on every create)."""
        now = self.clock()
        ttl = self.ttl
        seen = self._seen_at
        return {
            worker_id
            for worker_id, info in self._by_region.get(region, {}).items()
            if now - max(seen.get(f"{region}.{worker_id}", 0.0), info.heartbeat_at) <= ttl
            and not (self._suspected and self.suspected(worker_id))
        }

    def sample(
        self, region: str, k: int, rng: random.Random, exclude: AbstractSet[str] = frozenset()
    ) -> list[str] | None:
        """`k` distinct live workers of `region` not in `exclude`, drawn with `rng` in O(k) expected time
        whatever the region's size (p2c at 1,000 workers costs what it costs at 10), or None when the draw
        keeps failing (few workers left, most of them gone or excluded): then use `live_ids`.

        Draws come from the region's ids in sorted order, so a seed replays the same samples."""
        ids = self._sorted_ids.get(region)
        if ids is None:
            ids = self._sorted_ids[region] = sorted(self._by_region.get(region, {}))
        if len(ids) <= k + len(exclude):
            return None
        infos = self._by_region[region]
        now = self.clock()
        chosen: list[str] = []
        for _ in range(4 * k + 8):
            worker_id = ids[rng.randrange(len(ids))]
            info = infos.get(worker_id)
            if worker_id in exclude or worker_id in chosen or info is None:
                continue
            if self._suspected and self.suspected(worker_id):
                continue
            if now - max(self._seen_at.get(f"{region}.{worker_id}", 0.0), info.heartbeat_at) > self.ttl:
                continue
            chosen.append(worker_id)
            if len(chosen) == k:
                return chosen
        return None

    def regions(self) -> list[str]:
        return sorted({info.region for info in self.workers()})

    def is_live(self, worker_id: str) -> bool:
        return any(info.worker_id == worker_id and self._alive(key, info) for key, info in self._workers.items())

    def get(self, worker_id: str) -> WorkerInfo | None:
        for info in self._workers.values():
            if info.worker_id == worker_id:
                return info
        return None
