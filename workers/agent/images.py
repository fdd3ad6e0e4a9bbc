"""Images for the worker's cache: pulled from the fleet's image store, and named in offers and heartbeats.

The cache (`workers.image_cache`) unpacks what machines run and evicts the least recently used; here it
gets its fetch (archive and manifest by digest) and what it must keep (images of machines whose process
runs), and the agent gets the names it advertises (the auction prefers a worker that has the image).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bus.stores.images import ImageManifest, Images, image_store, is_digest, tags_bucket
from bus.transport.nats_adapter import JetStream
from workers.image_cache import ImageCache
from workers.log.machine_states import PROCESS_STATES
from workers.log.store import Store


async def open_image_cache(
    js: JetStream, root: Path, *, quota_bytes: int, in_use: Callable[[], set[str]]
) -> ImageCache:
    images = Images(js, await image_store(js), await tags_bucket(js))

    async def fetch(digest: str) -> tuple[bytes, ImageManifest | None]:
        return await images.pull(digest), await images.manifest(digest)

    return ImageCache(root, quota_bytes=quota_bytes, fetch=fetch, in_use=in_use)


def images_in_use(store: Store) -> set[str]:
    """Images of the machines whose process runs: the cache keeps them."""
    return {
        s.machine.config.image for s in store.machines() if s.machine.config.image and s.machine.state in PROCESS_STATES
    }


def images_named(seen: frozenset[str], cache: ImageCache | None) -> frozenset[str]:
    """Images named in offers and heartbeats: names machines ran with, and the digests on disk now."""
    if cache is None:
        return seen
    return frozenset(i for i in seen if not is_digest(i)) | cache.cached()
