"""The live-worker registry: a local replica of KV `fauxmad_workers`, kept current by a watch.

Brokers need to know, per region, which workers are alive (to know how many offers to wait for,
and whom p2c may sample) without asking anyone on the hot path. A KV watch delivers every
heartbeat and every expiry marker; a worker whose last heartbeat is older than the bucket TTL is
treated as gone even before its marker arrives. Time is injected, so staleness is testable.
The logical workers of one process beat under one key, their group's: the watch's update of it is each of
theirs (the members it changed), and its expiry each one's end (`bus.contract.beats.BeatGroups`).
Reconcilers read the same replica to know whose machines to ask for and whose are lost.

A reconciler may also `suspect` a worker it has just found silent (an edge proxy's connection was
refused and the worker itself did not answer): the worker counts as gone at once, without waiting for
its heartbeat to expire, until it proves otherwise with a heartbeat stamped after the suspicion (or
the TTL passes, by when an expired key says the same).

A silence of the whole bucket is the store's, not every worker's. When a server of a replicated fleet dies,
the workers bucket may have no leader until the others elect one (nats-server's raft: 4 to 9 s), or this
replica's watch may stall until it is made again: no heartbeat arrives from anyone, and the TTL alone would
empty the registry (`fauxmad workers`: "no live workers"; an operator would replace every machine). So when
no heartbeat at all has come from a bucket with two or more live workers for half a TTL, its workers are
judged as of the last heartbeat heard (the clock stops for them, up to `SILENCE_LIMIT`), expiry markers that
arrive meanwhile do not remove them, and when heartbeats come back each of those workers gets a TTL from then
to beat again. One worker dying never silences the others; two or more dying in the same instant are seen gone
after `SILENCE_LIMIT` rather than after the TTL. A supercluster's regions are separate buckets, judged apart.
A heartbeat delivered again (the very bytes last applied for its key: a watch made again replays the bucket's
current values) is no news: it neither ends a silence nor makes its worker younger. Taken for news, a new watch's
replay of the last beats ends the silence, and their expiry markers, a moment later, remove every worker: the
sequence that explains an empty `fauxmad workers` in CI, 5 s after a server's kill. For the same reason an expiry
marker of a beat from before the silence that arrives after its end (the new leader expired the old beats and took
the first new ones in either order) does not remove a worker the silence's end gave a TTL: that TTL judges it
(CI106: one of two workers unlisted 5.1 s after a server's kill).

Before its watch runs (a broker that answers while JetStream cannot make it one yet, orchestrator/broker/readiness.py),
the registry can `hear` the heartbeats as the workers publish them: a KV put is a message on `$KV.<bucket>.<key>`,
which a core NATS subscription receives whether or not a stream stores it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from bus.contract import subjects
from bus.contract.beats import BeatGroups
from bus.contract.codec import decoder
from bus.contract.fleet import WorkerInfo
from bus.transport.jetstream import WORKER_TTL
from bus.transport.nats_adapter import Bucket, Msg, Nats, Subscription
from orchestrator.replicas.replica import KVReplica

log = logging.getLogger(__name__)

SILENCE_LIMIT = 20.0  # seconds a bucket's silence is taken for the store's (an election, a watch made again)


class Registry(KVReplica):
    def __init__(self, *, ttl: float = WORKER_TTL, clock: Callable[[], float] = time.time) -> None:
        super().__init__(stall_after=ttl)  # live workers beat every HEARTBEAT_INTERVAL: a TTL of silence is a stall
        self.ttl = ttl
        self.clock = clock
        self._workers: dict[str, WorkerInfo] = {}  # key "<region>.<worker_id>"
        self._by_region: dict[str, dict[str, WorkerInfo]] = {}
        self._seen_at: dict[str, float] = {}
        self._beat: dict[str, bytes] = {}  # key -> the heartbeat last applied (a replay of it is no news)
        self._granted: set[str] = set()  # keys given a TTL by a silence's end, not yet heard from since
        self._sorted_ids: dict[str, list[str]] = {}  # per region, for O(1) sampling; dropped when membership changes
        self._departed: asyncio.Event | None = None
        self._suspected: dict[str, float] = {}  # worker id -> when it was found silent
        self._heard: dict[str, float] = {}  # bucket -> when the last heartbeat from it was applied
        self.bucket_of: Callable[[str], str] = lambda key: ""  # one bucket (a supercluster's: one per region)
        self._hearing: list[Subscription] = []  # heartbeats heard on core NATS until the watch runs (`hear`)
        self._groups = BeatGroups()  # a process's logical workers beat under one key: one update per worker

    async def start(self, kv: Bucket, timeout: float = 5.0) -> None:
        if getattr(kv, "buckets", None):  # a supercluster's regions (`bus.transport.regional`): a bucket each
            self.bucket_of = lambda key: key.split(".", 1)[0]
        await super().start(kv, timeout)

    async def hear(self, nc: Nats, buckets: list[str]) -> None:
        """Apply the heartbeats put into `buckets` as they are published (core NATS: no JetStream), until
        `stop_hearing`. Deletes say so in their `KV-Operation` header."""
        for bucket in buckets:
            prefix = subjects.kv_put(bucket, "")

            async def heard(msg: Msg, prefix: str = prefix) -> None:
                deleted = (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE")
                self._update(msg.subject[len(prefix) :], None if deleted else msg.data)

            self._hearing.append(await nc.subscribe(subjects.kv_put(bucket, ">"), cb=heard))

    async def stop_hearing(self) -> None:
        """The watch runs: it delivers every heartbeat from now on."""
        hearing, self._hearing = self._hearing, []
        for sub in hearing:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def close(self) -> None:
        await self.stop_hearing()
        await super().close()

    def _silent_since(self, bucket: str, now: float) -> float | None:
        """When `bucket` went silent, if its silence is the store's (see the module's docstring), else None."""
        heard = self._heard.get(bucket)
        if heard is None or not (self.ttl / 2 < now - heard <= SILENCE_LIMIT):
            return None
        live = 0
        for key, info in self._workers.items():
            if (
                self.bucket_of(key) == bucket
                and heard - max(self._seen_at.get(key, 0.0), info.heartbeat_at) <= self.ttl
            ):
                live += 1
                if live >= 2:
                    return heard
        return None

    def _fresh(self, key: str, info: WorkerInfo, now: float) -> bool:
        """Whether `key`'s last heartbeat is within the TTL, the clock stopped while its bucket is silent."""
        last = max(self._seen_at.get(key, 0.0), info.heartbeat_at)
        if now - last <= self.ttl:
            return True
        silent = self._silent_since(self.bucket_of(key), now)
        return silent is not None and silent - last <= self.ttl

    def _heard_from(self, key: str, now: float) -> None:
        bucket = self.bucket_of(key)
        silent = self._silent_since(bucket, now)
        if silent is not None:  # back from the store's silence: every worker live then gets a TTL from now
            for other, info in self._workers.items():
                if (
                    self.bucket_of(other) == bucket
                    and silent - max(self._seen_at.get(other, 0.0), info.heartbeat_at) <= self.ttl
                ):
                    self._seen_at[other] = now
                    self._granted.add(other)
        self._heard[bucket] = now

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
    def expand(self, key: str, value: bytes | None) -> list[tuple[str, bytes | None]]:
        return self._groups.updates(key, value)

    def apply(self, key: str, value: bytes | None) -> None:
        """Apply one KV update (`value=None`: the key was deleted or expired)."""
        if value is None:
            now = self.clock()
            if key in self._workers and self._silent_since(self.bucket_of(key), now) is not None:
                return  # expired for the store's silence, not the worker's: judged by its time (`_fresh`)
            if key in self._granted and now - self._seen_at.get(key, 0.0) <= self.ttl:
                return  # the marker of a beat from before the silence, come after its end: judged by its grant
            self._granted.discard(key)
            info = self._workers.pop(key, None)
            self._seen_at.pop(key, None)
            self._beat.pop(key, None)
            if info is not None:
                self._by_region.get(info.region, {}).pop(info.worker_id, None)
                self._sorted_ids.pop(info.region, None)
            departed, self._departed = self._departed, None
            if departed is not None:
                departed.set()
        else:
            if self._beat.get(key) == value and key in self._workers:
                return  # delivered again (a new watch's current values): heard already
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
            now = self.clock()
            self._heard_from(key, now)
            self._granted.discard(key)  # heard from itself
            self._workers[key] = info
            self._seen_at[key] = now
            self._beat[key] = value
            self._by_region.setdefault(info.region, {})[info.worker_id] = info

    def _alive(self, key: str, info: WorkerInfo) -> bool:
        if self._suspected and self.suspected(info.worker_id):
            return False
        return self._fresh(key, info, self.clock())

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
        return {
            worker_id
            for worker_id, info in self._by_region.get(region, {}).items()
            if self._fresh(f"{region}.{worker_id}", info, now) and not (self._suspected and self.suspected(worker_id))
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
            if not self._fresh(f"{region}.{worker_id}", info, now):
                continue
            chosen.append(worker_id)
            if len(chosen) == k:
                return chosen
        return None

    def unread(self) -> frozenset[str]:
        """Regions whose workers this replica has not read yet (a supercluster's region that did not answer this
        process's watch): their workers are unknown, not absent. Empty for a single bucket."""
        unread = getattr(self._watcher, "unread", None)
        return unread() if callable(unread) else frozenset()

    async def read(self, regions: AbstractSet[str], within: float) -> frozenset[str]:
        """Wait (at most `within` seconds) until the workers of every region in `regions` have been read; the
        regions still unread then."""
        deadline = time.perf_counter() + within
        while (left := self.unread() & regions) and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
        return frozenset(left)

    def regions(self) -> list[str]:
        return sorted({info.region for info in self.workers()})

    def is_live(self, worker_id: str) -> bool:
        return any(info.worker_id == worker_id and self._alive(key, info) for key, info in self._workers.items())

    def in_region(self, region: str, worker_id: str) -> WorkerInfo | None:
        """A worker's last heartbeat, alive or not, found in O(1) (the edge asks on every new connection)."""
        return self._by_region.get(region, {}).get(worker_id)

    def get(self, worker_id: str) -> WorkerInfo | None:
        for info in self._workers.values():
            if info.worker_id == worker_id:
                return info
        return None
