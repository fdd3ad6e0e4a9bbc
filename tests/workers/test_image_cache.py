"""The worker's image cache on real files: one pull per digest at a time, verified before unpacking,
least recently used evicted under the quota but never an image in use, half-done pulls cleaned at start.
The store is a function here (the cache takes its fetcher as a parameter); test_images.py uses the real one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bus.stores.images import ImageError, ImageManifest, build_archive, digest_of
from workers.image_cache import ImageCache


def image(tmp_path: Path, name: str, size: int) -> tuple[str, bytes]:
    source = tmp_path / "src" / name
    source.mkdir(parents=True)
    (source / "blob").write_bytes(os.urandom(size))
    data = build_archive(source)
    return digest_of(data), data


def cache_over(tmp_path: Path, store: dict[str, bytes], quota: int, busy: set[str]) -> tuple[ImageCache, list[str]]:
    fetched: list[str] = []

    async def fetch(digest: str) -> tuple[bytes, ImageManifest | None]:
        fetched.append(digest)
        await asyncio.sleep(0.05)  # a pull takes a while: concurrent asks overlap
        return store[digest], None

    return ImageCache(tmp_path / "cache", quota_bytes=quota, fetch=fetch, in_use=lambda: set(busy)), fetched


def test_concurrent_starts_share_one_pull(tmp_path: Path) -> None:
    digest, data = image(tmp_path, "a", 1000)
    cache, fetched = cache_over(tmp_path, {digest: data}, 10**9, set())

    async def main() -> list[str]:
        pulled = await asyncio.gather(*(cache.ensure(digest) for _ in range(5)))
        return [p.describe() for p in pulled]

    described = asyncio.run(main())
    assert fetched == [digest]
    assert sum(d.startswith("image pulled:") for d in described) == 1
    assert (cache.path(digest) / "blob").stat().st_size == 1000
    assert asyncio.run(cache.ensure(digest)).describe() == "image cached"


def test_eviction_keeps_the_quota_but_never_an_image_in_use(tmp_path: Path) -> None:
    a, b, c = (image(tmp_path, name, 400_000) for name in "abc")
    busy = {a[0]}
    cache, _ = cache_over(tmp_path, dict([a, b, c]), quota=900_000, busy=busy)

    async def main() -> None:
        await cache.ensure(a[0])
        await cache.ensure(b[0])
        await cache.ensure(c[0])  # over the quota: b goes (a is older but in use)

    asyncio.run(main())
    assert cache.cached() == {a[0], c[0]}
    assert (cache.path(a[0]) / "blob").exists() and not cache.path(b[0]).exists()


def test_a_mismatched_archive_is_refused_and_nothing_is_unpacked(tmp_path: Path) -> None:
    digest, _ = image(tmp_path, "a", 1000)
    cache, _ = cache_over(tmp_path, {digest: b"other bytes"}, 10**9, set())
    with pytest.raises(ImageError, match="refused"):
        asyncio.run(cache.ensure(digest))
    assert cache.cached() == set() and list((tmp_path / "cache").iterdir()) == []


def test_a_pull_cut_short_leaves_nothing_a_restart_would_use(tmp_path: Path) -> None:
    digest, data = image(tmp_path, "a", 1000)
    root = tmp_path / "cache"
    (root / f"{digest.removeprefix('sha256:')}.partial-4242").mkdir(parents=True)  # killed mid-unpack
    cache, fetched = cache_over(tmp_path, {digest: data}, 10**9, set())
    assert cache.cached() == set() and not list(root.glob("*.partial-*"))
    asyncio.run(cache.ensure(digest))
    assert fetched == [digest] and cache.cached() == {digest}
    again, _ = cache_over(tmp_path, {digest: data}, 10**9, set())  # a restart finds the finished one
    assert again.cached() == {digest}
