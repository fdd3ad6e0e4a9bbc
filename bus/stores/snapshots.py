"""Volume snapshots in JetStream: the store's name and what each object's description holds.

Workers write snapshots and read them to restore; brokers list them. Both need the same layout, so it
lives in the bus: object store `fauxmad_volume_snapshots`, one object per snapshot named by its id
(`vs_...`), the object's description the JSON of `SnapshotMeta` (the `VolumeSnapshot` and the size of the
volume it was taken of, which a restore must at least have). KV `fauxmad_volumes` routes a volume id to
its worker (a volume never moves, so its entry is written once, by the broker that created it).
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus.contract import subjects
from bus.contract.volumes import VolumeSnapshot
from bus.stores.objects import bind_or_create_store
from bus.transport.jetstream import bind_or_create_kv


class SnapshotMeta(msgspec.Struct, kw_only=True):
    snapshot: VolumeSnapshot
    size_gb: int


def decode_meta(description: str | None) -> SnapshotMeta | None:
    """The snapshot an object describes, or None for an object that is not one of ours."""
    if not description:
        return None
    try:
        return msgspec.json.decode(description, type=SnapshotMeta)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


async def snapshot_store(js: JetStreamContext) -> ObjectStore:
    return await bind_or_create_store(
        js, subjects.SNAPSHOTS_STORE, "volume snapshots: tar archives named by snapshot id (vs_...)"
    )


async def volumes_bucket(js: JetStreamContext) -> KeyValue:
    """KV `fauxmad_volumes`: volume id -> `VolumeIndexEntry` (its worker), written by the broker that made it."""
    return await bind_or_create_kv(
        js,
        KeyValueConfig(
            bucket=subjects.VOLUMES_BUCKET,
            history=1,
            storage=StorageType.FILE,
            description="routing index: volume id -> worker, app, region",
        ),
    )
