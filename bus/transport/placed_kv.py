"""A KV bucket placed in one cluster of a supercluster: what both the fleet's buckets (`jetstream`) and the fleet's
layout bucket (`fleet_layout`) need, in a module of its own so that neither imports the other for it.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, PersistMode, StreamConfig
from nats.js.kv import KeyValue

from bus.contract import subjects


async def create_placed_kv(
    js: JetStreamContext, config: KeyValueConfig, persist_mode: PersistMode | None = None
) -> KeyValue:
    """A KV bucket in the cluster `config.placement` names: nats-py's `create_key_value` leaves placement out of
    the stream it creates (the stream would land wherever the request did), so the stream is made here with
    the settings nats-py gives a bucket, plus the placement, and then bound as a bucket. `persist_mode`: the
    stream's (async: acked before it is on disk; nats-server allows it on one replica only)."""
    assert config.bucket is not None
    marker_ttl = config.limit_marker_ttl if config.limit_marker_ttl and config.limit_marker_ttl > 0 else None
    await js.add_stream(
        StreamConfig(
            name=f"KV_{config.bucket}",
            description=config.description,
            subjects=[subjects.kv_put(config.bucket, ">")],
            allow_direct=config.direct,
            allow_rollup_hdrs=True,
            allow_msg_ttl=True,
            deny_delete=True,
            discard=DiscardPolicy.NEW,
            duplicate_window=min(120.0, config.ttl) if config.ttl else 120.0,
            max_age=config.ttl,
            max_bytes=config.max_bytes,
            max_consumers=-1,
            max_msg_size=config.max_value_size,
            max_msgs=-1,
            max_msgs_per_subject=config.history,
            num_replicas=config.replicas,
            storage=config.storage,
            placement=config.placement,
            subject_delete_marker_ttl=marker_ttl,
            persist_mode=persist_mode,
        )
    )
    return await js.key_value(config.bucket)
