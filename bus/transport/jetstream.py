"""The JetStream resources of the contract: KV buckets, the events and logs streams, the images store.

Every process calls `ensure_fleet_resources` at start-up; creation is idempotent, so whichever
process comes first creates them and the others bind. The workers bucket has a TTL of about three
heartbeats with limit markers on, so a watcher sees a worker's key deleted when it stops beating.

The events stream keeps events for an age and up to a size that are configuration: a `FleetConfig`
field, else `$FAUXMAD_EVENTS_MAX_AGE` (`7d`, `12h`, seconds) and `$FAUXMAD_EVENTS_MAX_BYTES`
(`1GiB`, `512MB`, bytes). Limits given either way are applied to an existing stream too; a process
that was given none leaves the stream's limits as they are (defaults: 7 days, 1 GiB).

Where they live and how many replicas each has is the fleet's layout, kept in the fleet
(`bus.transport.fleet_layout`: KV `fauxmad_layout`, written by the first process, read by every process at
start): on one cluster every bucket and stream gets the layout's replicas (R3 on three servers, R1 on one).
In a supercluster each region gets its own workers, machines and idempotency buckets and its own events
stream, placed in its cluster and replicated inside it; the fleet
keeps one `FAUXMAD_EVENTS`, which sources every region's events (a stream with sources keeps pulling what
a region wrote while it was cut off once it is back, so the fleet-wide log is late, never missing); the
fleet-wide buckets and streams (apps, images, logs, audit, tokens, secrets) live in the home region.

The logs stream (`FAUXMAD_LOGS`, every `fauxmad.v1.logs.<app>.<machine>` line the workers publish)
works the same way with `$FAUXMAD_LOGS_MAX_AGE` and `$FAUXMAD_LOGS_MAX_BYTES` (defaults: 1 day,
256 MiB), and refuses a message above `LOGS_MAX_MSG_SIZE`: workers clip lines well below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, PersistMode, Placement, StorageType, StreamConfig, StreamSource
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from bus.contract import subjects
from bus.contract.base import seconds
from bus.contract.errors import BadRequest, Unreachable
from bus.transport import layout as layouts
from bus.transport.at_home import at_home, home_silent
from bus.transport.fleet_layout import Told, clustered, fleet_layout, why_unanswered
from bus.transport.layout import Layout
from bus.transport.nats_adapter import Bucket
from bus.transport.placed_kv import create_placed_kv
from bus.transport.regional import RegionalKV

log = logging.getLogger(__name__)

OTHER_REGION_WAIT = 3.0  # seconds a process waits for a region not its own before binding it unseen

HEARTBEAT_INTERVAL = 1.0
WORKER_TTL = 3 * HEARTBEAT_INTERVAL
# seconds a host's clock may be off its NATS server's (docs/explanation/faults.md "Skewed clocks"): the broker's
# wait after a timed-out reserve allows this much (`orchestrator.broker.auction.CLOCK_SKEW`), and a worker whose
# measured skew is surely past it refuses every reserve, saying by how much
MAX_CLOCK_SKEW = 0.25

EVENTS_MAX_AGE_ENV = "FAUXMAD_EVENTS_MAX_AGE"
EVENTS_MAX_BYTES_ENV = "FAUXMAD_EVENTS_MAX_BYTES"
DEFAULT_EVENTS_MAX_AGE = 7 * 24 * 3600.0
DEFAULT_EVENTS_MAX_BYTES = 1024 * 1024 * 1024

LOGS_MAX_AGE_ENV = "FAUXMAD_LOGS_MAX_AGE"
LOGS_MAX_BYTES_ENV = "FAUXMAD_LOGS_MAX_BYTES"
DEFAULT_LOGS_MAX_AGE = 24 * 3600.0
DEFAULT_LOGS_MAX_BYTES = 256 * 1024 * 1024
# A worker clips a line to 16 KiB of UTF-8 (workers/output.py); JSON escapes a byte into at most 6
# (`\u001b`), so an encoded line with its other fields stays below 100 KiB. A bigger message is not
# stored (one bad publisher cannot put megabytes in the stream per line).
LOGS_MAX_MSG_SIZE = 128 * 1024

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?$", re.IGNORECASE)
_SIZE_UNIT = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


class FleetConfig(msgspec.Struct, kw_only=True):
    """Limits of the shared JetStream resources (configuration, not contract).

    `events_max_age` (seconds) and `events_max_bytes` (and the same for `logs_`) left at `None` come
    from the environment; when neither says anything, an existing stream keeps its limits and a new
    one gets the defaults.
    """

    heartbeat_interval: float = HEARTBEAT_INTERVAL
    events_max_age: float | None = None
    events_max_bytes: int | None = None
    logs_max_age: float | None = None
    logs_max_bytes: int | None = None
    storage: str = "file"
    layout: Layout | None = None  # None: the fleet's (`bus.transport.fleet_layout`), checked against the environment
    region: str | None = None  # this process's own region (a worker's; a broker's or operator's if it has one)

    async def resolved_layout(self, js: JetStreamContext) -> Layout:
        """The fleet's layout; this config's `layout`, when given, must be it (else `LayoutConflict`)."""
        return await fleet_layout(js, Told.exactly(self.layout) if self.layout is not None else None)


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512MB`, `1GiB` (decimal and binary units)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise ValueError(f"invalid size {text!r}: use bytes or a size like '512MB' or '1GiB'")
    size = int(float(match.group(1)) * _SIZE_UNIT[(match.group(2) or "b").lower()])
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: must be positive")
    return size


class StreamLimits(msgspec.Struct, frozen=True):
    max_age: float
    max_bytes: int
    explicit: bool  # given by configuration (apply to an existing stream), not just the defaults


EventsLimits = StreamLimits


def _stream_limits(
    what: str,
    age: float | None,
    size: int | None,
    env: tuple[str, str],
    defaults: tuple[float, int],
    environ: Mapping[str, str],
) -> StreamLimits:
    """A stream's limits: the config's (`age`, `size`), else the environment's (`env`), else `defaults`."""
    age_text, bytes_text = environ.get(env[0], ""), environ.get(env[1], "")
    try:
        max_age = age if age is not None else (seconds(age_text) if age_text else None)
        max_bytes = size if size is not None else (parse_size(bytes_text) if bytes_text else None)
    except ValueError as exc:
        raise ValueError(f"{what} limits: {exc}") from None
    if max_age is not None and max_age <= 0:
        raise ValueError(f"{what} limits: max age must be positive, not {max_age:g}")
    return StreamLimits(
        max_age=defaults[0] if max_age is None else max_age,
        max_bytes=defaults[1] if max_bytes is None else max_bytes,
        explicit=max_age is not None or max_bytes is not None,
    )


def events_limits(config: FleetConfig, environ: Mapping[str, str] = os.environ) -> StreamLimits:
    """The events stream's limits: the config's, else the environment's, else the defaults."""
    return _stream_limits(
        "events stream",
        config.events_max_age,
        config.events_max_bytes,
        (EVENTS_MAX_AGE_ENV, EVENTS_MAX_BYTES_ENV),
        (DEFAULT_EVENTS_MAX_AGE, DEFAULT_EVENTS_MAX_BYTES),
        environ,
    )


def logs_limits(config: FleetConfig, environ: Mapping[str, str] = os.environ) -> StreamLimits:
    """The logs stream's limits: the config's, else the environment's, else the defaults."""
    return _stream_limits(
        "logs stream",
        config.logs_max_age,
        config.logs_max_bytes,
        (LOGS_MAX_AGE_ENV, LOGS_MAX_BYTES_ENV),
        (DEFAULT_LOGS_MAX_AGE, DEFAULT_LOGS_MAX_BYTES),
        environ,
    )


def _cannot_create(stream: str) -> Unreachable:
    """A create that got no answer: JetStream is down, or (in a secure fleet) this identity may not create
    streams and the server dropped the request. Either way, say what to do."""
    return Unreachable(
        f"stream {stream} does not exist and could not be created: in a secure fleet only the operator may"
        " create the fleet's streams (run `fauxmad fleet prepare` with the operator's credentials)"
    )


class FleetKV(msgspec.Struct, frozen=True):
    workers: Bucket  # one bucket, or a supercluster's bucket per region (`RegionalKV`)
    machines: Bucket
    apps: KeyValue  # fleet-wide: one bucket in the home region
    idempotency: KeyValue | RegionalKV  # a supercluster's brokers claim a key in the create's region's own bucket
    layout: Layout = Layout()

    def claims(self, region: str) -> KeyValue:
        """The bucket that keeps the idempotency claims of creates in `region`: the fleet's, or in a supercluster
        the region's own (so a region cut off from the others keeps placing idempotently); a region outside the
        supercluster's layout: this process's own region's."""
        if not isinstance(self.idempotency, RegionalKV):
            return self.idempotency
        regional = self.idempotency
        found = regional.buckets.get(region) or (regional.buckets.get(regional.own) if regional.own else None)
        if found is None:
            raise BadRequest(f"region {region!r} is not one of this supercluster's ({', '.join(regional.buckets)})")
        return found


def place_at_home(config: Any, layout: Layout) -> Any:
    """A fleet-wide bucket's or object store's config (one with no placement yet) replicated as `layout` says,
    and in a supercluster placed in the home region's cluster. Returns `config`."""
    if config.placement is None:
        config.replicas = layout.replicas
        if layout.supercluster:
            config.placement = Placement(cluster=layout.home)
    return config


async def bind_or_create_kv(js: JetStreamContext, config: KeyValueConfig, *, replica: bool = False) -> KeyValue:
    """Bind to the bucket, creating it only if it is not there: in a secure fleet only an operator may
    create streams (a worker's or broker's create would be refused), and binding needs read access only.
    A fleet-wide bucket: in a supercluster whose home region does not answer, bound unseen (`at_home`).

    `replica`: the bucket only holds what its writers write again by themselves (the routing index: a replica
    of the workers' logs, put again after every reconnect; the heartbeats: each put again every interval and
    expired by the bucket's TTL), so on a lone server, on one replica and on disk, it is made with
    `persist_mode` async, acked without an fsync per write (nats-server allows that on one replica only; a
    replicated bucket keeps the default, and so does one on a cluster's server, which `fauxmad fleet replicas 3`
    could only replicate by making it again, empty). A bucket made before keeps what it was made with."""
    bucket = config.bucket
    assert bucket is not None

    def unseen() -> KeyValue:
        return KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js, direct=False)

    return await at_home(js, f"KV_{bucket}", lambda: _bind_or_create_kv(js, config, replica=replica), unseen)


async def _bind_or_create_kv(js: JetStreamContext, config: KeyValueConfig, *, replica: bool) -> KeyValue:
    assert config.bucket is not None
    try:
        return await _bind_kv(js, config.bucket)
    except (NotFoundError, BucketNotFoundError):
        pass
    place_at_home(config, await fleet_layout(js, fresh=True))  # created now: as the fleet's layout says now
    # a lone server only: a bucket of a cluster may be moved to R3 (`fauxmad fleet replicas`), which would make an
    # async one again, empty (`fleet_layout._move_stream`)
    unsynced = replica and (config.replicas or 1) <= 1 and config.storage != StorageType.MEMORY and not clustered(js)
    try:
        if config.placement is not None or unsynced:
            return await create_placed_kv(js, config, PersistMode.ASYNC if unsynced else None)
        return await js.create_key_value(config)
    except BadRequestError:
        # created meanwhile by another process, with a different config (an older layout): bind to it
        return await _bind_kv(js, config.bucket)
    except TimeoutError:
        raise _cannot_create(f"KV_{config.bucket}") from None


async def _bind_kv(js: JetStreamContext, bucket: str) -> KeyValue:
    """`js.key_value(bucket)`, with a stream that cannot answer now said in one line (Unreachable): after a
    server of its cluster dies, a replicated stream has no leader until the others elect one (nats-server's raft
    takes 4 to 9 s), and a bucket that is not there at all stays NotFound for the caller to create."""
    try:
        return await js.key_value(bucket)
    except (NotFoundError, BucketNotFoundError):
        raise
    except (TimeoutError, APIError) as exc:
        why = why_unanswered(exc)
        raise Unreachable(
            f"the fleet's stream KV_{bucket} cannot answer now ({why}): its cluster may be electing a leader after"
            " losing a server; try again in a few seconds"
        ) from None


AGENT_PATIENCE = 30.0  # seconds an agent's start waits for JetStream to answer


async def ensure_fleet_resources_patiently(
    js: JetStreamContext, config: FleetConfig | None = None, *, within: float = AGENT_PATIENCE
) -> FleetKV:
    """`ensure_fleet_resources` for an agent's start (a worker, a broker, a proxy): JetStream that cannot answer
    now is asked again every half second for up to `within` seconds, said once in the log, before the one-line
    error. A cluster that starts with the fleet, or elects a stream's leader after losing a server, does not
    answer for a few seconds; an agent started then waits it out rather than exiting for its supervisor to
    start it again. A command keeps failing at once with "try again in a few seconds"."""
    give_up = time.monotonic() + within
    said = False
    while True:
        try:
            return await ensure_fleet_resources(js, config)
        except Unreachable as exc:
            if time.monotonic() >= give_up:
                raise
            if not said:
                log.warning("%s (asking again for up to %gs)", exc, within)
                said = True
            await asyncio.sleep(0.5)


async def ensure_fleet_resources(
    js: JetStreamContext, config: FleetConfig | None = None, *, every_region: bool = False
) -> FleetKV:
    """Bind the fleet's buckets and streams, creating the missing ones.

    In a supercluster, this process's own region (`config.region`) must answer, and so must every region with
    `every_region=True` (setting a fleet up: `fauxmad fleet prepare`, a dev fleet's start). Another region that
    cannot answer now (cut off, or electing its streams' leaders after losing a server) is bound without a
    round trip and read as soon as it answers (`bus.transport.regional`), so one region's outage never stops a process
    from starting elsewhere."""
    config = config or FleetConfig()
    layout = await config.resolved_layout(js)  # first: a process told another layout writes nothing
    if layout.supercluster:
        unanswered: set[str] = set()
        regional = await _regions(js, config, layout, every_region, unanswered)
        apps = await _apps_bucket(js, config)
        await _fleet_events(js, config, layout)
        await ensure_logs_stream(js, config)
        own, silent = config.region, frozenset(unanswered)
        return FleetKV(
            workers=RegionalKV({r: kvs[0] for r, kvs in regional.items()}, own, unanswered=silent),
            machines=RegionalKV({r: kvs[1] for r, kvs in regional.items()}, own, unanswered=silent),
            apps=apps,
            idempotency=RegionalKV({r: kvs[2] for r, kvs in regional.items()}, own, unanswered=silent),
            layout=layout,
        )
    events = await _limited_stream(
        js,
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            subjects=[subjects.EVENTS_ALL],
            storage=_storage(config),
            description="every machine state transition, from every worker",
        ),
        events_limits(config),
    )
    if events.sources and not events.subjects:  # made by a supercluster's processes: never add one-server buckets
        raise Unreachable(
            f"this fleet is a supercluster ({subjects.EVENTS_STREAM} sources its regions' events): set"
            f" ${layouts.SUPERCLUSTER_ENV} to its regions, e.g. {','.join(_source_regions(events))}"
        )
    workers, machines, idempotency = await _state_buckets(js, config, layout, None)
    apps = await _apps_bucket(js, config)
    await ensure_logs_stream(js, config)
    return FleetKV(workers=workers, machines=machines, apps=apps, idempotency=idempotency, layout=layout)


def _source_regions(events: StreamConfig) -> list[str]:
    prefix = f"{subjects.EVENTS_STREAM}_"
    return [src.name.removeprefix(prefix) for src in events.sources or [] if src.name.startswith(prefix)]


def _storage(config: FleetConfig) -> StorageType:
    return StorageType.MEMORY if config.storage == "memory" else StorageType.FILE


def _in_region(kv: KeyValueConfig, layout: Layout, region: str | None) -> KeyValueConfig:
    if region is not None:
        kv.placement, kv.replicas, kv.direct = Placement(cluster=region), layout.replicas, True
    return kv


async def _state_buckets(
    js: JetStreamContext, config: FleetConfig, layout: Layout, region: str | None
) -> tuple[KeyValue, KeyValue, KeyValue]:
    """The heartbeats, routing index and idempotency buckets: the fleet's (`region=None`) or one region's."""
    storage = _storage(config)
    ttl = 3 * config.heartbeat_interval
    where = f" of region {region}" if region else ""
    workers = await bind_or_create_kv(
        js,
        _in_region(
            KeyValueConfig(
                bucket=layout.workers_bucket(region) if region else subjects.WORKERS_BUCKET,
                ttl=ttl,
                limit_marker_ttl=ttl,
                history=1,
                storage=storage,
                description=f"worker heartbeats{where}: capacity, usage, images, cordon",
            ),
            layout,
            region,
        ),
        # every worker puts its key again each interval and a key lives a TTL of three: a heartbeat that a killed
        # server lost is replaced by the next one, so on one server it is not fsync'd per write (at 1,000 workers
        # 1,000 flushes a second less; docs/explanation/architecture.md#the-heartbeats-unsynced-on-one-server)
        replica=True,
    )
    machines = await bind_or_create_kv(
        js,
        _in_region(
            KeyValueConfig(
                bucket=layout.machines_bucket(region) if region else subjects.MACHINES_BUCKET,
                history=1,
                storage=storage,
                description=f"routing index{where}: machine id -> worker, region, app, state",
            ),
            layout,
            region,
        ),
        # a replica of the workers' logs, which put every entry again after a reconnect: not fsync'd per write on
        # one server (docs/explanation/architecture.md#one-durable-write-per-create)
        replica=True,
    )
    idempotency = await bind_or_create_kv(
        js,
        _in_region(
            KeyValueConfig(
                bucket=layout.idempotency_bucket(region) if region else subjects.IDEMPOTENCY_BUCKET,
                ttl=24 * 3600.0,
                history=1,
                storage=storage,
                description=f"create idempotency keys{where}: claimed by one broker, answered with one machine",
            ),
            layout,
            region,
        ),
    )
    return workers, machines, idempotency


async def _regions(
    js: JetStreamContext, config: FleetConfig, layout: Layout, every_region: bool, unanswered: set[str] | None = None
) -> dict[str, tuple[KeyValue, KeyValue, KeyValue]]:
    """Every region's three buckets, the regions asked at once (in a real supercluster each is a WAN away); the
    regions that did not answer (bound unseen) are added to `unanswered`."""

    failed: list[Exception] = []

    async def one(region: str) -> tuple[KeyValue, KeyValue, KeyValue]:
        if every_region or region == config.region:
            return await _region_resources(js, config, layout, region)
        try:
            return await asyncio.wait_for(_region_resources(js, config, layout, region), OTHER_REGION_WAIT)
        except (Unreachable, TimeoutError, APIError) as exc:
            failed.append(exc)
            if unanswered is not None:
                unanswered.add(region)
            if region == layout.home:
                home_silent(js)  # the fleet-wide binds that follow need not wait for it again
            why = getattr(exc, "message", None) or getattr(exc, "description", None) or "no answer"
            log.warning("region %s's streams do not answer now (%s): reading them as soon as they do", region, why)
            return _unseen_region(js, layout, region)

    found = await asyncio.gather(*(one(region) for region in layout.regions))
    if len(failed) == len(layout.regions):  # not one region's outage: JetStream itself, or missing permissions
        first = failed[0]
        raise first if isinstance(first, Unreachable) else Unreachable(f"no region's streams answer: {first!r}")
    return dict(zip(layout.regions, found, strict=True))


def _unseen_region(js: JetStreamContext, layout: Layout, region: str) -> tuple[KeyValue, KeyValue, KeyValue]:
    """A region's buckets bound without asking its cluster (made as `_state_buckets` makes them: direct gets)."""

    def bound(bucket: str) -> KeyValue:
        return KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js, direct=True)

    return (
        bound(layout.workers_bucket(region)),
        bound(layout.machines_bucket(region)),
        bound(layout.idempotency_bucket(region)),
    )


async def _region_resources(
    js: JetStreamContext, config: FleetConfig, layout: Layout, region: str
) -> tuple[KeyValue, KeyValue, KeyValue]:
    """One region's own state, in its own cluster: three buckets and its events stream."""
    buckets = await _state_buckets(js, config, layout, region)
    await _limited_stream(
        js,
        StreamConfig(
            name=layout.events_stream(region),
            subjects=[subjects.events_of_region(region)],
            storage=_storage(config),
            placement=Placement(cluster=region),
            num_replicas=layout.replicas,
            description=f"every machine state transition in region {region}",
        ),
        events_limits(config),
    )
    return buckets


async def _fleet_events(js: JetStreamContext, config: FleetConfig, layout: Layout) -> None:
    """`FAUXMAD_EVENTS` of a supercluster: no subjects of its own, every region's events stream as a source."""
    await _fleet_wide_stream(
        js,
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            sources=[StreamSource(name=layout.events_stream(region)) for region in layout.regions],
            storage=_storage(config),
            placement=Placement(cluster=layout.home),
            num_replicas=layout.replicas,
            description="every machine state transition, sourced from every region's events stream",
        ),
        events_limits(config),
    )


async def _apps_bucket(js: JetStreamContext, config: FleetConfig) -> KeyValue:
    return await bind_or_create_kv(
        js,
        KeyValueConfig(
            bucket=subjects.APPS_BUCKET,
            history=16,
            storage=_storage(config),
            description="desired state: app specs and releases",
        ),
    )


async def ensure_logs_stream(js: JetStreamContext, config: FleetConfig | None = None) -> None:
    """The logs stream alone (what a log reader needs), created or bound like the others."""
    config = config or FleetConfig()
    await _fleet_wide_stream(
        js,
        StreamConfig(
            name=subjects.LOGS_STREAM,
            subjects=[subjects.LOGS_ALL],
            max_msg_size=LOGS_MAX_MSG_SIZE,
            storage=StorageType.MEMORY if config.storage == "memory" else StorageType.FILE,
            description="machines' stdout and stderr lines, from every worker",
        ),
        logs_limits(config),
    )


AUDIT_MAX_AGE = 90 * 24 * 3600.0  # an audit trail outlives the events it explains


async def ensure_audit_stream(js: JetStreamContext) -> None:
    """The audit stream (mutating requests and who made them), created or bound like the others."""
    await _fleet_wide_stream(
        js,
        StreamConfig(
            name=subjects.AUDIT_STREAM,
            subjects=[subjects.AUDIT_ALL],
            storage=StorageType.FILE,
            description="every mutating API request (HTTP or NATS), with the identity that made it",
        ),
        StreamLimits(max_age=AUDIT_MAX_AGE, max_bytes=1 << 30, explicit=False),
    )


async def revoked_tokens_bucket(js: JetStreamContext) -> KeyValue:
    """KV `fauxmad_revoked_tokens`: a key per revoked HTTP API token id; every API process watches it."""
    return await bind_or_create_kv(
        js,
        KeyValueConfig(
            bucket=subjects.REVOKED_TOKENS_BUCKET,
            history=1,
            storage=StorageType.FILE,
            description="revoked HTTP API tokens (and every token attenuated from them)",
        ),
    )


async def _fleet_wide_stream(js: JetStreamContext, stream: StreamConfig, limits: StreamLimits) -> StreamConfig:
    """`_limited_stream` of a fleet-wide stream: in a supercluster whose home region does not answer, left for
    later (`at_home`): this process only publishes to it, and a publish that finds no stream fails on its own."""
    return await at_home(js, f"stream {stream.name}", lambda: _limited_stream(js, stream, limits), lambda: stream)


async def _limited_stream(js: JetStreamContext, stream: StreamConfig, limits: StreamLimits) -> StreamConfig:
    """Create `stream` with `limits`; if it exists, apply them only when they were configured. Returns the
    stream's config (the one found, or the one created)."""
    assert stream.name is not None
    stream.max_age, stream.max_bytes = limits.max_age, limits.max_bytes
    try:  # look before creating: in a secure fleet only an operator may create (see `bind_or_create_kv`)
        current = (await js.stream_info(stream.name)).config
    except NotFoundError:
        if stream.placement is None:  # a fleet-wide stream: replicated as the layout says, at home in a supercluster
            layout = await fleet_layout(js, fresh=True)
            stream.num_replicas = layout.replicas
            if layout.supercluster:
                stream.placement = Placement(cluster=layout.home)
        if (stream.num_replicas or 1) > 1:
            stream.persist_mode = None  # nats-server persists a replicated stream through its raft log, never async
        try:
            await js.add_stream(stream)
            return stream
        except BadRequestError:  # created meanwhile by another process
            current = (await js.stream_info(stream.name)).config
        except TimeoutError:
            raise _cannot_create(stream.name) from None
    if not limits.explicit:
        return current  # exists with other limits, and nobody asked for these: leave it as it is
    if current.max_age != limits.max_age or current.max_bytes != limits.max_bytes:
        current.max_age, current.max_bytes = limits.max_age, limits.max_bytes
        await js.update_stream(current)
    return current


# ---------------------------------------------------------------------------------------------------
# Background jobs (addition, docs/how-to/jobs.md)

JOBS_ACK_WAIT = 6.0  # a taken job not acked or renewed for this long is given to another worker
# A work queue's `Nats-Msg-Id` window (seconds): a keyed submit's message published twice within it is stored
# once. Its check (the queue, then the records) covers what is older; this covers two submits racing.
JOBS_DUPLICATE_WINDOW = 120.0
JOBS_DEAD_MAX_AGE = 30 * 24 * 3600.0
JOB_EVENTS_MAX_AGE = 24 * 3600.0


class JobsResources(msgspec.Struct, frozen=True):
    kv: KeyValue  # KV `fauxmad_jobs`
    stream: str  # the region's work-queue stream


async def ensure_jobs_resources(js: JetStreamContext, region: str, *, ack_wait: float = JOBS_ACK_WAIT) -> JobsResources:
    """KV `fauxmad_jobs`, the dead letters and job events streams, and region `region`'s work queue with its
    one durable pull consumer (`workers`): created if missing, bound otherwise."""
    from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy

    kv = await bind_or_create_kv(
        js,
        KeyValueConfig(
            bucket=subjects.JOBS_BUCKET,
            history=1,
            storage=StorageType.FILE,
            description="background jobs: one record per job (state, attempts, exit status, output)",
        ),
    )
    await _limited_stream(
        js,
        StreamConfig(
            name=subjects.JOBS_DEAD_STREAM,
            subjects=[subjects.JOBS_DEAD_ALL],
            storage=StorageType.FILE,
            description="jobs that failed every attempt (dead letters): their final record",
        ),
        StreamLimits(max_age=JOBS_DEAD_MAX_AGE, max_bytes=1 << 30, explicit=False),
    )
    await _limited_stream(
        js,
        StreamConfig(
            name=subjects.JOB_EVENTS_STREAM,
            subjects=[subjects.JOB_EVENTS_ALL],
            storage=StorageType.FILE,
            description="every job state change",
            # job events are core publishes (nobody is told they were stored; the records are the truth), so
            # the stream need not flush each one to disk before the next: three flushes less per job
            persist_mode=PersistMode.ASYNC,
        ),
        StreamLimits(max_age=JOB_EVENTS_MAX_AGE, max_bytes=256 << 20, explicit=False),
    )
    stream = subjects.jobs_stream(region)
    queue_subjects = [subjects.jobs_queue(region), subjects.jobs_queue_jobs(region)]
    current = await _limited_stream(
        js,
        StreamConfig(
            name=stream,
            subjects=queue_subjects,
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            description=f"the work queue of region {region}: a message per job until a worker acks it",
            duplicate_window=JOBS_DUPLICATE_WINDOW,
        ),
        StreamLimits(max_age=0.0, max_bytes=-1, explicit=False),
    )
    if not set(queue_subjects) <= set(current.subjects or []):  # made before the per-job subjects: added to it
        current.subjects = sorted({*(current.subjects or []), *queue_subjects})
        with contextlib.suppress(BadRequestError):  # updated meanwhile by another worker
            await js.update_stream(current)
    try:
        await js.consumer_info(stream, subjects.JOBS_CONSUMER)
    except TimeoutError:
        raise _cannot_create(f"{stream} (its consumer {subjects.JOBS_CONSUMER})") from None
    except NotFoundError:
        with contextlib.suppress(BadRequestError):  # created meanwhile by another worker
            await js.add_consumer(
                stream,
                ConsumerConfig(
                    durable_name=subjects.JOBS_CONSUMER,
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=ack_wait,
                    max_deliver=-1,
                    max_ack_pending=-1,
                    max_waiting=4096,
                ),
            )
    return JobsResources(kv=kv, stream=stream)
