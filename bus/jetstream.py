"""The JetStream resources of the contract: KV buckets, the events stream, the images store.

Every process calls `ensure_fleet_resources` at start-up; creation is idempotent, so whichever
process comes first creates them and the others bind. The workers bucket has a TTL of about three
heartbeats with limit markers on, so a watcher sees a worker's key deleted when it stops beating.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from bus import subjects

HEARTBEAT_INTERVAL = 1.0
WORKER_TTL = 3 * HEARTBEAT_INTERVAL


class FleetConfig(msgspec.Struct, kw_only=True):
    """Limits of the shared JetStream resources (configuration, not contract)."""

    heartbeat_interval: float = HEARTBEAT_INTERVAL
    events_max_age: float = 7 * 24 * 3600.0
    events_max_bytes: int = 1024 * 1024 * 1024
    storage: str = "file"


class FleetKV(msgspec.Struct, frozen=True):
    workers: Any
    machines: Any
    apps: Any
    idempotency: Any


async def _kv(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.create_key_value(config)
    except BadRequestError:
        # exists with a different config (an older layout): bind to what is there
        return await js.key_value(config.bucket)


async def ensure_fleet_resources(js: JetStreamContext, config: FleetConfig | None = None) -> FleetKV:
    config = config or FleetConfig()
    storage = StorageType.MEMORY if config.storage == "memory" else StorageType.FILE
    ttl = 3 * config.heartbeat_interval
    workers = await _kv(
        js,
        KeyValueConfig(
            bucket=subjects.WORKERS_BUCKET, ttl=ttl, limit_marker_ttl=ttl, history=1, storage=storage,
            description="worker heartbeats: capacity, usage, images, cordon",
        ),
    )
    machines = await _kv(
        js,
        KeyValueConfig(
            bucket=subjects.MACHINES_BUCKET, history=1, storage=storage,
            description="routing index: machine id -> worker, region, app, state",
        ),
    )
    apps = await _kv(
        js,
        KeyValueConfig(
            bucket=subjects.APPS_BUCKET, history=16, storage=storage,
            description="desired state: app specs and releases",
        ),
    )
    idempotency = await _kv(
        js,
        KeyValueConfig(
            bucket=subjects.IDEMPOTENCY_BUCKET, ttl=24 * 3600.0, history=1, storage=storage,
            description="create idempotency keys: claimed by one broker, answered with one machine",
        ),
    )
    with contextlib.suppress(BadRequestError):
        await js.add_stream(
            StreamConfig(
                name=subjects.EVENTS_STREAM,
                subjects=[subjects.EVENTS_ALL],
                max_age=config.events_max_age,
                max_bytes=config.events_max_bytes,
                storage=storage,
                description="every machine state transition, from every worker",
            )
        )
    return FleetKV(workers=workers, machines=machines, apps=apps, idempotency=idempotency)
