"""The route table: apps and their machines, from local replicas of three KV buckets, never a broker.

`fauxmad_machines` (the routing index: each machine's worker, region, state and port), `fauxmad_workers`
(live workers: a machine on a worker whose heartbeat expired is not routed to) and `fauxmad_apps` (each
app's current release, for its `[http_service]` and, for auto_create, the machine config). Workers write
the index after every transition, so the table follows starts and stops within a publish.

Entries only move forward: a machine's index entry carries the worker's log sequence (`version`), and an
older one arriving late (the watch can deliver a `starting` after the proxy already learned `started`
from the start's reply) is ignored.

A request for an app the watch has not brought yet (its release published a moment ago) reads KV once before
it is answered 404 (`AppsReplica.fetch`), so a release is served as soon as it is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from bus.contract.codec import decoder
from bus.contract.machines import CORDONED_LABEL, JOB_LABEL, MachineIndexEntry
from bus.transport.jetstream import FleetKV
from orchestrator.apps.http_service import HttpService
from orchestrator.apps.ownership import RegionRange, region_range
from orchestrator.apps.spec import AppSpec
from orchestrator.replicas.machines import MachineIndex
from orchestrator.replicas.replica import KVReplica
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)
DEFAULT_SERVICE = HttpService()
LIVE_FOR = 0.1  # seconds a region's live workers are reused between requests (heartbeats expire in seconds)
MISSED_FOR = 1.0  # seconds an app name KV did not know is not asked for again
MISSED_KEPT = 10_000  # names remembered as missing, at most (then forgotten all at once)
# labels of machines no request goes to, that this proxy neither starts nor stops: cordoned ones, and jobs' machines
_NOT_ROUTED = frozenset({CORDONED_LABEL, JOB_LABEL})
CATCH_UP = 1.0  # seconds a request for an app with no machines known waits for the machines index to catch up


class _Head(msgspec.Struct):
    version: int
    destroyed: bool = False


class _Release(msgspec.Struct):
    version: int
    spec: AppSpec


class App(msgspec.Struct, frozen=True):
    """What the proxy knows of one app: its service settings and, when it has a release, the spec."""

    name: str
    service: HttpService
    release: int = 0
    spec: AppSpec | None = None

    def region_range(self, region: str) -> RegionRange:
        """How far this proxy may go in `region`: the rule the operator follows too (`reconcile.ownership`)."""
        return region_range(self.spec.regions.get(region, 0) if self.spec else 0, self.service)

    def may_stop(self, region: str, running: int) -> int:
        """How many idle machines autostop may stop in `region` while `running` of them run."""
        return self.region_range(region).to_stop(running)


class AppsReplica(KVReplica):
    """KV `fauxmad_apps`: `<app>.current` and `<app>.releases.<N>` (only the current one's spec is kept)."""

    def __init__(self) -> None:
        super().__init__()
        self._heads: dict[str, int] = {}
        self._releases: dict[tuple[str, int], AppSpec] = {}
        self._current: dict[str, App] = {}  # `current`'s answers until the next change
        self._missed: dict[str, float] = {}  # app -> when `fetch` last found nothing (see MISSED_FOR)

    def apply(self, key: str, value: bytes | None) -> None:
        self._current.clear()
        parts = key.split(".")
        if len(parts) == 2 and parts[1] == "current":
            head = None
            if value is not None:
                try:
                    head = decoder(_Head).decode(value)
                except Exception:
                    log.warning("apps: ignoring malformed head %s", key)
            if head is None or head.destroyed or head.version == 0:
                self._heads.pop(parts[0], None)
            else:
                self._heads[parts[0]] = head.version
        elif len(parts) == 3 and parts[1] == "releases" and parts[2].isdigit():
            if value is None:
                self._releases.pop((parts[0], int(parts[2])), None)
                return
            try:
                release = decoder(_Release).decode(value)
            except Exception:
                log.warning("apps: ignoring a release I cannot read: %s", key)
                return
            self._releases[(parts[0], release.version)] = release.spec

    async def fetch(self, app: str, clock: Callable[[], float] = time.monotonic) -> None:
        """Read `app`'s head and current release from KV now, for a request that names an app the watch has not
        brought yet (a release published a moment ago). A name found missing is not asked again for a second:
        a client can make up any number of them."""
        if self._kv is None or app in self._heads:
            return
        now = clock()
        if now - self._missed.get(app, -MISSED_FOR) < MISSED_FOR:
            return
        if len(self._missed) > MISSED_KEPT:
            self._missed.clear()
        self._missed[app] = now
        head = await self._get(f"{app}.current")
        if head is None:
            return
        self.apply(f"{app}.current", head)
        version = self._heads.get(app)
        if version is not None and (app, version) not in self._releases:
            release = await self._get(f"{app}.releases.{version}")
            if release is not None:
                self.apply(f"{app}.releases.{version}", release)

    async def _get(self, key: str) -> bytes | None:
        if self._kv is None:  # not started
            return None
        try:
            entry = await self._kv.get(key)
        except Exception:  # not there, or KV unreachable: the request gets its 404, as it would have
            return None
        return None if entry is None else entry.value

    def names(self) -> list[str]:
        """Apps with a current release."""
        return sorted(self._heads)

    def current(self, app: str) -> App | None:
        found = self._current.get(app)
        if found is None:
            found = self._read(app)
            if found is not None:  # unknown names are not kept: a client can make up any number
                self._current[app] = found
        return found

    def _read(self, app: str) -> App | None:
        version = self._heads.get(app)
        if version is None:
            return None
        spec = self._releases.get((app, version))
        service = spec.http_service if spec is not None and spec.http_service is not None else DEFAULT_SERVICE
        return App(name=app, service=service, release=version, spec=spec)


class OrderedIndex(MachineIndex):
    """The routing index, where an entry older than the one held (a lower `version`) is ignored. It notes when
    it saw each machine become `started` (`started_at`, on `clock`): a process binds its port a moment after."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self.started_at: dict[str, float] = {}

    def apply(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.started_at.pop(key, None)
            super().apply(key, value)
            return
        try:
            entry = decoder(MachineIndexEntry).decode(value)
        except Exception:
            log.warning("index: ignoring malformed entry %s", key)
            return
        self.remember(entry)

    def remember(self, entry: MachineIndexEntry) -> None:
        held = self.get(entry.id)
        if held is None or entry.version >= held.version or entry.worker_id != held.worker_id:
            if entry.state != "started":
                self.started_at.pop(entry.id, None)
            elif held is not None and (held.state != "started" or held.worker_id != entry.worker_id):
                self.started_at[entry.id] = self.clock()  # a start seen happen (one first seen started: not known when)
            super().remember(entry)

    def by_app_all(self) -> list[MachineIndexEntry]:
        return list(self._entries.values())


class RouteTable:
    def __init__(self, *, registry: Registry | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = OrderedIndex(clock)
        self.registry = registry or Registry()
        self.apps = AppsReplica()
        self._by_app: dict[str, list[MachineIndexEntry]] | None = None
        self._live: dict[str, tuple[float, set[str]]] = {}  # region -> (when, its live workers)
        self._caught: dict[str, float] = {}  # app -> when `caught_up` last waited for the index on its behalf
        self.index.on_change = self._changed

    def _changed(self, key: str) -> None:
        self._by_app = None

    async def start(self, kv: FleetKV) -> None:
        """`kv`: the `FleetKV` of `bus.transport.jetstream.ensure_fleet_resources`."""
        await self.registry.start(kv.workers)
        await self.index.start(kv.machines)
        await self.apps.start(kv.apps)

    async def close(self) -> None:
        for replica in (self.apps, self.index, self.registry):
            await replica.close()

    async def caught_up(self, app: str, clock: Callable[[], float] = time.monotonic) -> bool:
        """Whether the machines index now holds every update its bucket had a moment ago (`KVReplica.caught_up`,
        within CATCH_UP): asked before an app is answered "no machines", which a watch running behind (a
        machine created a moment ago, a busy host) would otherwise say of machines that exist. At most once a
        second per app: an app that has none is refused at once after that."""
        now = clock()
        if now - self._caught.get(app, -MISSED_FOR) < MISSED_FOR:
            return False
        if len(self._caught) > MISSED_KEPT:
            self._caught.clear()
        self._caught[app] = now
        return await self.index.caught_up(CATCH_UP)

    def remember(self, entry: MachineIndexEntry) -> None:
        """What a start or create through a broker answered: known before the index's watch says so."""
        self.index.remember(entry)
        self._by_app = None

    async def fetch_app(self, name: str) -> App | None:
        """`app(name)`, after reading KV once for an app the watch has not brought yet."""
        await self.apps.fetch(name)
        return self.app(name)

    def app(self, name: str) -> App | None:
        """The app, or None when the fleet knows no such app (no current release and no machine)."""
        found = self.apps.current(name)
        if found is not None:
            return found
        if self.machines(name):
            return App(name=name, service=DEFAULT_SERVICE)
        return None

    def machines(self, app: str) -> list[MachineIndexEntry]:
        """The app's machines on live workers, destroyed and cordoned ones and those of its jobs left out."""
        if self._by_app is None:
            grouped: dict[str, list[MachineIndexEntry]] = {}
            for entry in self.index.by_app_all():
                if entry.state != "destroyed" and not _NOT_ROUTED.intersection(entry.metadata):
                    grouped.setdefault(entry.app, []).append(entry)
            self._by_app = grouped
        entries = self._by_app.get(app, [])
        now = self.registry.clock()
        out = []
        for entry in entries:
            held = self._live.get(entry.region)
            if held is None or now - held[0] > LIVE_FOR:
                held = self._live[entry.region] = (now, self.registry.live_ids(entry.region))
            if entry.worker_id in held[1]:
                out.append(entry)
        return out

    def entry(self, machine_id: str) -> MachineIndexEntry | None:
        return self.index.get(machine_id)

    def started_within(self, machine_id: str, seconds: float) -> bool:
        """Whether this table saw the machine become `started` less than `seconds` ago (on its clock) and it has not
        accepted a connection since (`bound`)."""
        at = self.index.started_at.get(machine_id)
        return at is not None and self.index.clock() - at < seconds

    def bound(self, machine_id: str) -> None:
        """The machine accepted a connection: it listens, and a refusal from now on is not its start's."""
        if self.index.started_at:
            self.index.started_at.pop(machine_id, None)

    def regions(self) -> list[str]:
        return self.registry.regions()
