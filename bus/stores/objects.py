"""Reading and creating JetStream object stores fast: shared by images and volume snapshots.

nats-py's `ObjectStore.get` grows a bytes object chunk by chunk (quadratic: 8 MB/s for 50 MB here), or
hops to a thread per chunk; an ordered push consumer paces itself with flow control (about 40 MB/s).
`read_chunks` instead fetches an object's chunks 64 a request with a pull consumer on their subject
(145-213 MB/s), and hands each chunk to the caller, so a large object can go straight to a file.

`stored_digest` reads the SHA-256 the writer's client recorded in the object's info (`SHA-256=<base64>`)
as fauxmad writes digests (`sha256:<hex>`): images and snapshots are named or described by the digest of
their bytes, and comparing the two tells, without reading the object, whether the store holds those bytes.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ObjectInfo, ObjectStoreConfig, StorageType
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.object_store import ObjectStore

from bus.transport.at_home import at_home
from bus.transport.fleet_layout import fleet_layout
from bus.transport.jetstream import place_at_home

PULL_BATCH = 64  # chunks (128 KiB each) per fetch
DIGEST_PREFIX = "SHA-256="


def stored_digest(info: ObjectInfo | None) -> str | None:
    """`sha256:<hex>` of the object's bytes as its info records them, or None when it records none we read."""
    raw = info.digest if info is not None else None
    if not raw or not raw.upper().startswith(DIGEST_PREFIX):
        return None
    encoded = raw[len(DIGEST_PREFIX) :]
    try:
        value = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        return None
    return "sha256:" + value.hex() if len(value) == 32 else None


async def bind_or_create_store(js: JetStreamContext, bucket: str, description: str) -> ObjectStore:
    """Bind to the object store, creating it only if it is not there (as `bind_or_create_kv` does; in a
    supercluster whose home region does not answer, bound unseen: `at_home`)."""

    def unseen() -> ObjectStore:
        return ObjectStore(name=bucket, stream=f"OBJ_{bucket}", js=js)

    return await at_home(js, f"OBJ_{bucket}", lambda: _bind_or_create_store(js, bucket, description), unseen)


async def _bind_or_create_store(js: JetStreamContext, bucket: str, description: str) -> ObjectStore:
    try:
        return await js.object_store(bucket)
    except (NotFoundError, BadRequestError):
        pass
    try:
        layout = await fleet_layout(js, fresh=True)  # created now: as the fleet's layout says now
        config = place_at_home(ObjectStoreConfig(description=description, storage=StorageType.FILE), layout)
        return await js.create_object_store(bucket, config)
    except BadRequestError:
        return await js.object_store(bucket)


async def read_chunks(js: JetStreamContext, bucket: str, info: ObjectInfo) -> AsyncIterator[bytes]:
    """The chunks of the object `info` describes, in order (the caller checks the digest)."""
    size = info.size or 0
    if size == 0 or not info.nuid:
        return
    sub = await js.pull_subscribe(
        f"$O.{bucket}.C.{info.nuid}",
        stream=f"OBJ_{bucket}",
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=30.0),
    )
    got = 0
    try:
        while got < size:
            for msg in await sub.fetch(batch=PULL_BATCH, timeout=10):
                got += len(msg.data)
                yield msg.data
    finally:
        await sub.unsubscribe()
