"""The worker's image cache: pull once, verify, unpack once, share read-only, evict least recently used.

A machine whose `config.image` is a digest runs in its unpacked image (its working directory, its
files); every machine of that image shares the one copy. Decision: shared and read-only rather than a
copy per machine. A copy costs a full write of the image per start (50 MB: tens of milliseconds and the
disk), and an overlay needs privileges or FUSE this worker may not have. An image is immutable: a machine
writes to its own directory (`$HOME` and `$TMPDIR` point there), and a sandboxed one (`bwrap`) sees the
image through a read-only bind mount, so it cannot write into it even as root.

- Concurrent pulls of one digest share one download (a burst of creates pulls it once).
- A pull is checked against its digest before anything is unpacked; an archive is unpacked into a
  `<hex>.partial-<pid>` directory and renamed into place, so a worker killed mid-pull or mid-unpack
  leaves no half image behind (start-up removes the partial ones), and a reader never sees one.
- Eviction keeps the cache under its quota (`--image-cache-mb`), least recently used first, and never
  removes an image a machine in a process state uses (`in_use`): if that leaves the cache over quota,
  it stays over until they stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.stores.images import ImageError, ImageManifest, is_digest, unpack

log = logging.getLogger(__name__)

Fetch = Callable[[str], Awaitable[tuple[bytes, ImageManifest | None]]]


class Pulled:
    """An image ready on disk: where, its manifest, and what the pull cost (0 bytes: it was cached)."""

    def __init__(
        self, root: Path, manifest: ImageManifest | None, pulled_bytes: int, seconds: float, *, shared: bool = False
    ) -> None:
        self.root = root
        self.manifest = manifest
        self.pulled_bytes = pulled_bytes
        self.seconds = seconds
        self.shared = shared  # waited for another start's pull

    @property
    def workdir(self) -> Path:
        relative = (self.manifest.workdir if self.manifest else "").strip("/")
        return self.root / relative if relative else self.root

    def describe(self) -> str:
        if self.shared:
            return f"image pulled by another start, waited {self.seconds:.2f} s"
        if not self.pulled_bytes:
            return "image cached"
        return f"image pulled: {self.pulled_bytes / 1e6:.1f} MB in {self.seconds:.2f} s"


class ImageCache:
    def __init__(self, root: Path, *, quota_bytes: int, fetch: Fetch, in_use: Callable[[], set[str]] = set) -> None:
        self.root = root
        self.quota_bytes = quota_bytes
        self.fetch = fetch
        self.in_use = in_use
        self._pulls: dict[str, asyncio.Future[Pulled]] = {}
        self._manifests: dict[str, ImageManifest | None] = {}
        self._used_at: dict[str, float] = {}
        self.pulls = 0  # downloads done (a test counts them)
        self.version = 0  # changes whenever the set of cached images does (offers are answered again until then)
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob("*.partial-*"):  # a pull cut short by a kill
            shutil.rmtree(leftover, ignore_errors=True)
        for done in root.iterdir():
            if not done.name.endswith(".manifest") and "." not in done.name:
                self._used_at["sha256:" + done.name] = done.stat().st_mtime

    def path(self, digest: str) -> Path:
        return self.root / digest.removeprefix("sha256:")

    def cached(self) -> set[str]:
        return set(self._used_at)

    def ready(self, digest: str) -> Pulled | None:
        """The image if it is on disk now (no pull): what `task_spec` uses."""
        if digest not in self._used_at:
            return None
        return Pulled(self.path(digest), self._manifest(digest), 0, 0.0)

    async def ensure(self, digest: str) -> Pulled:
        """The image on disk, pulled and unpacked first if needed (one pull per digest at a time)."""
        if not is_digest(digest):
            raise ImageError(f"not an image digest: {digest!r}")
        ready = self.ready(digest)
        if ready is not None:
            self._touch(digest)
            return ready
        pending = self._pulls.get(digest)
        if pending is not None:  # another start is pulling it: share that pull
            pulled = await asyncio.shield(pending)
            return Pulled(pulled.root, pulled.manifest, 0, pulled.seconds, shared=True)
        pending = self._pulls[digest] = asyncio.ensure_future(self._pull(digest))
        pending.add_done_callback(lambda _: self._pulls.pop(digest, None))
        return await asyncio.shield(pending)

    async def _pull(self, digest: str) -> Pulled:
        started = time.perf_counter()
        data, manifest = await self.fetch(digest)  # checked against the digest by the fetcher
        self.pulls += 1
        final = self.path(digest)
        partial = self.root / f"{final.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        await asyncio.to_thread(unpack, data, digest, partial)
        if manifest is not None:
            (self.root / f"{final.name}.manifest").write_bytes(_encode(manifest))
        os.rename(partial, final)
        self._manifests[digest] = manifest
        self._touch(digest)
        await asyncio.to_thread(self.evict, self.in_use())
        return Pulled(final, manifest, len(data), time.perf_counter() - started)

    def _touch(self, digest: str) -> None:
        if digest not in self._used_at:
            self.version += 1
        self._used_at[digest] = time.time()

    def _manifest(self, digest: str) -> ImageManifest | None:
        if digest not in self._manifests:
            path = self.root / f"{digest.removeprefix('sha256:')}.manifest"
            self._manifests[digest] = _decode(path.read_bytes()) if path.exists() else None
        return self._manifests[digest]

    def size(self, digest: str) -> int:
        total = 0
        for dirpath, _, files in os.walk(self.path(digest)):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def evict(self, busy: set[str]) -> list[str]:
        """Remove least recently used images not in `busy` until the cache fits its quota; returns them."""
        sizes = {digest: self.size(digest) for digest in list(self._used_at)}
        total = sum(sizes.values())
        removed = []
        for digest in sorted(sizes, key=lambda d: self._used_at.get(d, 0.0)):
            if total <= self.quota_bytes:
                break
            if digest in busy:
                continue
            shutil.rmtree(self.path(digest), ignore_errors=True)
            (self.root / f"{digest.removeprefix('sha256:')}.manifest").unlink(missing_ok=True)
            self._used_at.pop(digest, None)
            self._manifests.pop(digest, None)
            self.version += 1
            total -= sizes[digest]
            removed.append(digest)
            log.info("image cache: evicted %s (%d bytes)", digest, sizes[digest])
        return removed


def _encode(manifest: ImageManifest) -> bytes:
    import msgspec

    return msgspec.json.encode(manifest)


def _decode(data: bytes) -> ImageManifest | None:
    import msgspec

    try:
        return msgspec.json.decode(data, type=ImageManifest)
    except msgspec.DecodeError:
        return None
