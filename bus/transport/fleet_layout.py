"""The fleet's layout, kept in the fleet: KV `fauxmad_layout`, key `layout`.

Why: where the fleet's state lives (one cluster or a supercluster's regions, which region is home, how many
replicas each bucket and stream has) is a property of the fleet, not of each process. When every process
read it from its own environment (`$FAUXMAD_SUPERCLUSTER`, `$FAUXMAD_REPLICAS`), a process started without
them, or with other values, silently used other bucket names and replicas: three servers in one cluster ran
the workers registry R1 on one of them, and killing that one emptied `fauxmad workers`.

So the first process on an empty fleet (or `fauxmad fleet prepare`, `fauxmad fleet layout`) writes the layout
here, and every process reads it at start and follows it. What a process was told (the variables, or a
`FleetConfig.layout`) only has to agree: a contradiction stops it with one line naming both, before anything is
written. Replicas default to what the servers offer: a cluster of three or more servers gets R3, one server R1
(read from the server's INFO: `connect_urls` lists every server of its cluster). A fleet made before the layout
was kept gets the layout its streams already have (a supercluster's `FAUXMAD_EVENTS` names its regions).

`fauxmad fleet replicas N` (`set_replicas`) moves an existing fleet: the record first (so a stream created
meanwhile gets N), then every fauxmad stream and bucket in place (a JetStream stream update; consumers follow
their stream). A stream kept with async persistence (job events) cannot be replicated nor have that changed:
it is made again, empty (its entries are notifications, the job records are the truth).
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, Placement, StorageType, StreamConfig
from nats.js.errors import (
    APIError,
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ServiceUnavailableError,
)

from bus.contract import subjects
from bus.contract.errors import Conflict, Unreachable
from bus.transport import layout as layouts
from bus.transport.layout import Layout
from bus.transport.nats_adapter import connection_of, server_info
from bus.transport.placed_kv import create_placed_kv

log = logging.getLogger(__name__)

LAYOUT_BUCKET = "fauxmad_layout"
LAYOUT_KEY = "layout"
REPLICA_CHOICES = (1, 3, 5)


class LayoutConflict(Conflict):
    """This process was told a layout the fleet's stored one contradicts: it must not start."""


class StoredLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The record in KV `fauxmad_layout`: regions and the NATS cluster of each, the home region, replicas."""

    regions: list[str] = msgspec.field(default_factory=list)  # empty: one cluster (or one server)
    clusters: dict[str, str] = msgspec.field(default_factory=dict)  # region -> its cluster (the region's name)
    home: str | None = None
    replicas: int = 1

    @classmethod
    def of(cls, layout: Layout) -> StoredLayout:
        return cls(
            regions=list(layout.regions),
            clusters={r: r for r in layout.regions},
            home=layout.home,
            replicas=layout.replicas,
        )

    def layout(self) -> Layout:
        regions = list(self.regions)
        if self.home is not None and self.home in regions:  # the home region first (`Layout.home`)
            regions.remove(self.home)
            regions.insert(0, self.home)
        return Layout(regions=tuple(regions), replicas=self.replicas)


class Told(msgspec.Struct, frozen=True):
    """What this process was told about the layout: each part None when it was told nothing about it."""

    regions: tuple[str, ...] | None = None
    replicas: int | None = None
    source: str = "its environment"

    @classmethod
    def exactly(cls, layout: Layout) -> Told:
        return cls(regions=layout.regions, replicas=layout.replicas, source="its configuration")

    def disagrees(self, layout: Layout) -> str | None:
        """What of `layout` this contradicts, said as what this process was told, or None."""
        told = []
        if self.regions is not None and tuple(self.regions) != layout.regions:
            told.append(f"regions {','.join(self.regions)}" if self.regions else "no regions")
        if self.replicas is not None and self.replicas != layout.replicas:
            told.append(f"R{self.replicas}")
        return " and ".join(told) or None

    def first_layout(self, replicas: int) -> Layout:
        return Layout(regions=self.regions or (), replicas=self.replicas or replicas)


def told_by_env(environ: Mapping[str, str] = os.environ) -> Told:
    """`$FAUXMAD_SUPERCLUSTER` and `$FAUXMAD_REPLICAS`, each None when unset."""
    text = environ.get(layouts.SUPERCLUSTER_ENV, "").strip()
    regions = tuple(subjects.check_token("region", r.strip()) for r in text.split(",") if r.strip()) or None
    replicas_text = environ.get(layouts.REPLICAS_ENV, "").strip()
    replicas = None
    if replicas_text:
        try:
            replicas = int(replicas_text)
        except ValueError:
            raise ValueError(f"${layouts.REPLICAS_ENV} must be 1, 3 or 5, not {replicas_text!r}") from None
        if replicas not in REPLICA_CHOICES:
            raise ValueError(f"${layouts.REPLICAS_ENV} must be 1, 3 or 5, not {replicas}")
    names = [n for n, v in ((layouts.SUPERCLUSTER_ENV, regions), (layouts.REPLICAS_ENV, replicas)) if v is not None]
    return Told(regions=regions, replicas=replicas, source=" and ".join(f"${n}" for n in names) or "nothing")


def describe(layout: Layout) -> str:
    if layout.supercluster:
        return f"regions {','.join(layout.regions)} (home {layout.home}), R{layout.replicas}"
    return f"one cluster, R{layout.replicas}"


# the layout each connection resolved (a process reads it once; tests run several fleets in one process)
_known: weakref.WeakKeyDictionary[Any, Layout] = weakref.WeakKeyDictionary()


def _connection(js: JetStreamContext) -> Any:
    return connection_of(js) or js


def _conflict(told: Told, stored: Layout) -> LayoutConflict | None:
    said = told.disagrees(stored)
    if said is None:
        return None
    return LayoutConflict(
        f"this process was told {said} ({told.source}) but the fleet's layout (KV {LAYOUT_BUCKET}) is"
        f" {describe(stored)}: unset or correct the setting, or change the fleet's layout (fauxmad fleet layout)"
    )


async def fleet_layout(js: JetStreamContext, told: Told | None = None, *, fresh: bool = False) -> Layout:
    """The fleet's layout: read once per connection (`fresh=True`: read again), written first if the fleet has
    none. Raises `LayoutConflict` when what this process was told (`told`, else its environment) disagrees."""
    told = told if told is not None else told_by_env()
    nc = _connection(js)
    layout = None if fresh else _known.get(nc)
    if layout is None:
        layout = await _read_or_write(js, told)
        _known[nc] = layout
    conflict = _conflict(told, layout)
    if conflict is not None:
        raise conflict
    return layout


def known_layout(js: JetStreamContext) -> Layout | None:
    """The layout this connection already resolved, without asking (None: not resolved yet)."""
    return _known.get(_connection(js))


def forget(js: JetStreamContext) -> None:
    """Read the layout again at the next `fleet_layout` (after this process changed it)."""
    _known.pop(_connection(js), None)


def why_unanswered(exc: TimeoutError | APIError) -> str:
    """Why JetStream gave no usable answer, in words: nats-py's 503 (nobody serves the API) has no description."""
    if isinstance(exc, TimeoutError):
        return "no answer"
    if isinstance(exc, ServiceUnavailableError) or exc.code == 503:
        return "JetStream does not answer: not enabled on this server, or electing a leader"
    return exc.description or f"error {exc.err_code}"


async def read_layout(js: JetStreamContext) -> Layout | None:
    """The stored layout, or None when the fleet has none yet."""
    try:
        kv = await js.key_value(LAYOUT_BUCKET)
        entry = await kv.get(LAYOUT_KEY)
    except (BucketNotFoundError, KeyNotFoundError, NotFoundError):
        return None
    except (TimeoutError, APIError) as exc:
        raise Unreachable(
            f"the fleet's layout (KV {LAYOUT_BUCKET}) cannot be read now ({why_unanswered(exc)}): try again in a few"
            " seconds"
        ) from None
    assert entry.value is not None
    return msgspec.json.decode(entry.value, type=StoredLayout).layout()


async def _read_or_write(js: JetStreamContext, told: Told) -> Layout:
    try:
        stored = await read_layout(js)
    except Unreachable:
        if told.regions is None:
            raise
        # a supercluster region cut off from the home region: what it was told is all it has
        layout = told.first_layout(3)
        log.warning("the fleet's layout cannot be read now: following what this process was told (%s)", told.source)
        return layout
    if stored is not None:
        return stored
    conflict_free = await _inferred(js, told)
    return await write_layout(js, conflict_free, only_if_absent=True)


async def _inferred(js: JetStreamContext, told: Told) -> Layout:
    """The first layout of a fleet that has none: what this process was told, completed from the streams a
    fleet made before the layout was kept, else from what the servers offer."""
    regions, replicas = told.regions, told.replicas
    events = await _stream_config(js, subjects.EVENTS_STREAM)
    if events is not None and events.sources and not events.subjects:  # a supercluster's
        prefix = f"{subjects.EVENTS_STREAM}_"
        found = tuple(s.name.removeprefix(prefix) for s in events.sources if s.name.startswith(prefix))
        if regions is None:
            home = events.placement.cluster if events.placement is not None else None
            regions = tuple(sorted(found, key=lambda r: r != home))
        if replicas is None:
            replicas = events.num_replicas or 1
    elif regions is None and replicas is None:
        workers = await _stream_config(js, f"KV_{subjects.WORKERS_BUCKET}")
        if workers is not None:  # a one-cluster fleet from before: keep its replicas (`fleet replicas` moves it)
            replicas = workers.num_replicas or 1
    if replicas is None:
        replicas = offered_replicas(js)
    return Layout(regions=regions or (), replicas=replicas)


async def _stream_config(js: JetStreamContext, name: str) -> StreamConfig | None:
    try:
        return (await js.stream_info(name)).config
    except NotFoundError:
        return None


def clustered(js: JetStreamContext) -> bool:
    """Whether the server this connection reached is in a cluster (its INFO names one)."""
    return bool(server_info(_connection(js)).get("cluster"))


def offered_replicas(js: JetStreamContext) -> int:
    """What the server this connection reached offers: R3 in a cluster of three or more servers (its INFO's
    `connect_urls` lists every server of its cluster), else R1."""
    info = server_info(_connection(js))
    if not info.get("cluster"):
        return 1
    return 3 if len(set(info.get("connect_urls") or [])) >= 3 else 1


async def write_layout(js: JetStreamContext, layout: Layout, *, only_if_absent: bool = False) -> Layout:
    """Store `layout` (`only_if_absent`: unless another process stored one first; then that one). Returns the
    layout the fleet now has."""
    kv = await _layout_bucket(js, layout)
    record = msgspec.json.encode(StoredLayout.of(layout))
    if only_if_absent:
        try:
            await kv.create(LAYOUT_KEY, record)
        except KeyWrongLastSequenceError:  # another process was first: its layout is the fleet's
            stored = await read_layout(js)
            assert stored is not None
            return stored
        log.info("the fleet's layout written: %s", describe(layout))
    else:
        await kv.put(LAYOUT_KEY, record)
    _known[_connection(js)] = layout
    return layout


async def _layout_bucket(js: JetStreamContext, layout: Layout) -> Any:
    try:
        return await js.key_value(LAYOUT_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        pass
    config = KeyValueConfig(
        bucket=LAYOUT_BUCKET,
        history=8,
        storage=StorageType.FILE,
        replicas=layout.replicas,
        description="the fleet's layout: regions and their clusters, home region, replicas",
    )
    if layout.supercluster:
        config.placement = Placement(cluster=layout.home)
    try:
        if config.placement is not None:
            return await create_placed_kv(js, config)
        return await js.create_key_value(config)
    except BadRequestError:  # made meanwhile by another process
        return await js.key_value(LAYOUT_BUCKET)
    except TimeoutError:
        raise Unreachable(
            f"the fleet's layout (KV {LAYOUT_BUCKET}) does not exist and could not be created: in a secure fleet"
            " only the operator may create the fleet's streams (run `fauxmad fleet prepare` with its credentials)"
        ) from None


# ---------------------------------------------------------------------------------------------------
# moving a fleet: `fauxmad fleet replicas N`

FLEET_STREAM_PREFIXES = ("KV_fauxmad_", "OBJ_fauxmad_", "FAUXMAD_")


async def fleet_streams(js: JetStreamContext) -> list[str]:
    """Every stream of the fleet (its buckets', object stores' and streams'), by name."""
    names: list[str] = []
    for info in await js.streams_info():
        if info.config.name and info.config.name.startswith(FLEET_STREAM_PREFIXES):
            names.append(info.config.name)
    return sorted(names)


async def set_replicas(js: JetStreamContext, replicas: int, *, timeout: float = 30.0) -> list[str]:
    """Move the fleet to `replicas`: the stored layout, then every stream of the fleet in place. Returns the
    streams changed. Streams already there are left alone, so running it again finishes a move cut short."""
    if replicas not in REPLICA_CHOICES:
        raise ValueError(f"replicas must be 1, 3 or 5, not {replicas}")
    layout = await fleet_layout(js, Told())
    moved = Layout(regions=layout.regions, replicas=replicas)
    if moved != layout:
        await write_layout(js, moved)
    changed: list[str] = []
    for name in await fleet_streams(js):
        if await _move_stream(js, name, replicas, timeout):
            changed.append(name)
    return changed


async def _move_stream(js: JetStreamContext, name: str, replicas: int, timeout: float) -> bool:
    from nats.js.api import PersistMode

    config = (await js.stream_info(name)).config
    if (config.num_replicas or 1) == replicas:
        return False
    config.num_replicas = replicas
    if config.persist_mode == PersistMode.ASYNC and replicas > 1:
        # async persistence cannot be replicated, nor changed by an update: made again (job events only)
        consumers = [c.config for c in await js.consumers_info(name)]
        await js.delete_stream(name)
        config.persist_mode = None
        await js.add_stream(config)
        for consumer in consumers:
            await js.add_consumer(name, consumer)
    else:
        await js.update_stream(config)
    await _wait_current(js, name, replicas, timeout)
    return True


async def _wait_current(js: JetStreamContext, name: str, replicas: int, timeout: float) -> None:
    """Until the stream has a leader and `replicas - 1` current followers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            cluster = (await js.stream_info(name)).cluster
            followers = [p for p in (cluster.replicas or []) if p.current and not p.offline] if cluster else []
            if replicas == 1 or (cluster is not None and cluster.leader and len(followers) >= replicas - 1):
                return
        except (TimeoutError, APIError):
            pass
        if loop.time() > deadline:
            raise Unreachable(f"stream {name} did not get {replicas} current replicas within {timeout:g}s")
        await asyncio.sleep(0.2)
