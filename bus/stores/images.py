"""Images: an app's files as one content-addressed archive, stored in JetStream, pulled by workers.

Both sides need the same definitions: the CLI builds and pushes, a worker pulls and verifies, so the
format, the digest and the store's names live here, in the bus.

- An image is a gzip'd tar of a directory, built deterministically: entries sorted, owners 0, mtimes
  0, modes kept (executable or not), no device files, gzip's own timestamp 0. The same tree gives the
  same bytes, so its `sha256:` digest names its content, and a rebuild of an unchanged app is a no-op.
- The archive is an object named by its digest in the object store `fauxmad_images` (JetStream
  chunks it); its manifest (`ImageManifest`: digest, size, created, cmd, env, workdir, the app that owns
  it) and the tags (`name:tag` -> digest) are keys of KV `fauxmad_image_tags`: `m.<hex>` and
  `t.<name>.<tag>`. A tag's name is an app's: only the operator and that app's deployer (through the
  brokers' checked push, `orchestrator.broker.images`) write `t.<app>.*`; the store's objects and the
  `m.*` manifests are written by the operator and the brokers only, never by a deployer directly, since no
  permission can check that bytes hash to their name (docs/how-to/secure-fleet.md: who may do what with images).
- Content addressing holds end to end: a push hashes the archive and refuses bytes that are not the
  manifest's digest (nothing stored, no manifest, no tag moved); an object counts as present only when the
  store's own SHA-256 of it (`ObjectInfo.digest`, `bus.stores.objects.stored_digest`) is that digest, so a
  damaged object is replaced by the next good push; whoever reads an archive checks its sha256 against the
  digest it asked for: a store that answers other bytes is refused with `ImageError`, never unpacked.
- Every door that takes an image reference (the CLI's `machine run`/`update`, a deploy's `image =`, the
  HTTP API's `config.image`, a job's `image`) goes through `resolve_image`: one rule for what a reference
  is (`name:tag` or `sha256:<hex>` of an image in the store), one error (`ImageError`, naming the
  reference), and the pinned digest with the manifest's defaults (the command a machine or job runs when it
  is given none, its env and workdir).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import re
import stat
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError, ObjectNotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus.contract import subjects
from bus.contract.images import DIGEST_PATTERN, IMAGE_TAG_PATTERN
from bus.contract.images import MAX_ARCHIVE as MAX_ARCHIVE
from bus.contract.images import ImageManifest as ImageManifest
from bus.stores.kv_keys import kv_keys
from bus.stores.objects import bind_or_create_store, read_chunks, stored_digest
from bus.transport.jetstream import bind_or_create_kv

DIGEST = re.compile(DIGEST_PATTERN)
TAG = re.compile(IMAGE_TAG_PATTERN)


class ImageError(Exception):
    """An image problem in plain words (unknown reference, digest mismatch, a directory that cannot be packed)."""


class ResolvedImage(msgspec.Struct, frozen=True, kw_only=True):
    """What a reference names: the digest to pin, and its manifest's defaults."""

    reference: str  # as the user gave it
    digest: str
    cmd: list[str] = []
    env: dict[str, str] = {}
    workdir: str = ""


def is_digest(reference: str | None) -> bool:
    return reference is not None and DIGEST.match(reference) is not None


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_bytes(digest: str, actual: str) -> None:
    """`ImageError` (one line, both digests) unless the archive's bytes, hashing to `actual`, are `digest`'s."""
    if actual != digest:
        raise ImageError(
            f"image {digest}: the archive's bytes hash to {actual}: refused (damaged or tampered);"
            " nothing was stored and no tag moved"
        )


def check_tag(tag: str) -> str:
    if not TAG.match(tag):
        raise ImageError(f"invalid tag {tag!r}: use name:tag (lowercase name; letters, digits, - and _)")
    return tag


# ---------------------------------------------------------------------------------------------------
# building


def build_archive(directory: Path) -> bytes:
    """The directory's deterministic archive (see the module docstring)."""
    if not directory.is_dir():
        raise ImageError(f"{directory} is not a directory")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(directory.rglob("*"), key=lambda p: p.relative_to(directory).as_posix()):
            relative = path.relative_to(directory).as_posix()
            if any(part in (".git", "__pycache__") for part in Path(relative).parts):
                continue
            info = tar.gettarinfo(str(path), arcname=relative)
            if not (info.isfile() or info.isdir() or info.issym()):
                continue  # sockets, fifos, devices: not part of an app
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755 if info.isdir() or (info.mode & stat.S_IXUSR) else 0o644
            if info.isfile():
                with path.open("rb") as content:
                    tar.addfile(info, content)
            else:
                tar.addfile(info)
    packed = io.BytesIO()
    with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(raw.getvalue())
    data = packed.getvalue()
    if len(data) > MAX_ARCHIVE:
        raise ImageError(f"{directory} packs to {len(data) >> 20} MiB, over the {MAX_ARCHIVE >> 20} MiB limit")
    return data


def manifest_for(data: bytes, *, cmd: list[str], env: dict[str, str], workdir: str, source: str) -> ImageManifest:
    return ImageManifest(
        digest=digest_of(data), size=len(data), created=time.time(), cmd=cmd, env=env, workdir=workdir, source=source
    )


def unpack(data: bytes, digest: str, into: Path) -> None:
    """Check `data` against `digest`, then unpack it into `into` (which must not exist yet)."""
    actual = digest_of(data)
    if actual != digest:
        raise ImageError(f"image {digest} from the store has digest {actual}: refused (damaged or overwritten)")
    into.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(into, filter="data")  # no absolute paths, no escapes, no devices


# ---------------------------------------------------------------------------------------------------
# the store


async def image_store(js: JetStreamContext) -> ObjectStore:
    return await bind_or_create_store(js, subjects.IMAGES_STORE, "image archives, named by their sha256 digest")


async def tags_bucket(js: JetStreamContext) -> KeyValue:
    return await bind_or_create_kv(
        js,
        KeyValueConfig(
            bucket=subjects.IMAGE_TAGS_BUCKET,
            history=1,
            storage=StorageType.FILE,
            description="image manifests (m.<hex>) and tags (t.<name>.<tag> -> digest)",
        ),
    )


def _manifest_key(digest: str) -> str:
    return "m." + digest.removeprefix("sha256:")


def _tag_key(tag: str) -> str:
    name, _, version = check_tag(tag).partition(":")
    return f"t.{name}.{version}"


class Images:
    """Push, pull, tag and list images: the object store and the tags bucket of one connection."""

    def __init__(self, js: JetStreamContext, store: ObjectStore, tags: KeyValue) -> None:
        self.js = js
        self.store = store
        self.tags = tags

    @classmethod
    async def open(cls, js: JetStreamContext) -> Images:
        return cls(js, await image_store(js), await tags_bucket(js))

    async def push(self, data: bytes, manifest: ImageManifest, tags: list[str]) -> ImageManifest:
        """Store the archive (unless the store holds it, verified) and its manifest; point `tags` at it.

        Bytes that do not hash to the manifest's digest are refused before anything is written. This writes the
        store directly: the operator's way (and an open fleet's); a deployer's goes through the brokers'
        checked push (`bus.stores.image_push`), which ends in `store_object` and `record` too."""
        for tag in tags:
            check_tag(tag)
        check_bytes(manifest.digest, digest_of(data))
        manifest = msgspec.structs.replace(manifest, size=len(data))
        await self.store_object(manifest.digest, data)
        return await self.record(manifest, tags)

    async def store_object(self, digest: str, data: bytes | IO[bytes]) -> None:
        """Write `data`, which its caller has checked hashes to `digest`, under that name, unless the store
        holds it whole already (an identical object is never rewritten; a damaged one is replaced)."""
        if await self.present(digest):
            return
        info = await self.store.put(digest, data)  # type: ignore[arg-type]  # a file object: nats-py reads it
        if stored_digest(info) != digest:  # what the store hashed is not what we hashed
            raise ImageError(f"image {digest}: the store took other bytes ({stored_digest(info)})")

    async def record(
        self,
        manifest: ImageManifest,
        tags: list[str],
        check: Callable[[ImageManifest | None], None] = lambda known: None,
    ) -> ImageManifest:
        """Write `manifest` (its tags merged with those it had, the app that owns it kept) and point `tags` at it.

        `check` sees the manifest stored now and raises to refuse; the write is a compare-and-set on what it
        saw, so two pushes of one digest at once cannot both pass a check made against the same old state."""
        key = _manifest_key(manifest.digest)
        for _ in range(5):
            try:
                entry = await self.tags.get(key)
            except (NotFoundError, KeyError):
                entry = None
            known = msgspec.json.decode(entry.value, type=ImageManifest) if entry is not None and entry.value else None
            check(known)
            merged = msgspec.structs.replace(
                manifest,
                tags=sorted(set(tags) | set(known.tags if known else [])),
                app=known.app if known is not None else manifest.app,
            )
            encoded = msgspec.json.encode(merged)
            try:
                if entry is None or entry.revision is None:
                    await self.tags.create(key, encoded)
                else:
                    await self.tags.update(key, encoded, last=entry.revision)
            except KeyWrongLastSequenceError:
                continue  # someone wrote it meanwhile: check again against what is there now
            for tag in tags:
                await self.tags.put(_tag_key(tag), manifest.digest.encode())
            return merged
        raise ImageError(f"image {manifest.digest}: its manifest kept changing under this push; try again")

    async def present(self, digest: str) -> bool:
        """Whether the store holds `digest`'s object whole: the SHA-256 the store recorded for it is `digest`
        (a size that matches proves nothing: an object damaged in place, or put under that name with other
        bytes, keeps it)."""
        try:
            info = await self.store.get_info(digest)
        except (ObjectNotFoundError, NotFoundError):
            return False
        return info is not None and not info.deleted and stored_digest(info) == digest

    async def resolve(self, reference: str) -> str:
        """A digest for `name:tag` or a digest; `ImageError` if there is no such image."""
        return (await resolve_image(self, reference)).digest

    async def manifest(self, digest: str) -> ImageManifest | None:
        try:
            entry = await self.tags.get(_manifest_key(digest))
        except (NotFoundError, KeyError):
            return None
        if entry is None or not entry.value:
            return None
        return msgspec.json.decode(entry.value, type=ImageManifest)

    async def pull(self, digest: str) -> bytes:
        """The archive's bytes, checked against `digest` (`ImageError` if missing or not matching)."""
        data = await self._read(digest)
        actual = digest_of(data)
        if actual != digest:
            raise ImageError(f"image {digest} from the store has digest {actual}: refused (damaged or overwritten)")
        return data

    async def _read(self, name: str) -> bytes:
        """The object's bytes, by `bus.stores.objects.read_chunks` (our digest check replaces the store's)."""
        try:
            info = await self.store.get_info(name)
        except ObjectNotFoundError:
            raise ImageError(f"no image {name} in the fleet's store") from None
        buffer = bytearray()
        async for chunk in read_chunks(self.js, subjects.IMAGES_STORE, info):
            buffer += chunk
        return bytes(buffer)

    async def list(self) -> list[ImageManifest]:
        """Every manifest, its keys read from the bucket's stream (`bus.stores.kv_keys`: nats-py's
        `KeyValue.keys()` answered NoKeysError for a bucket full of manifests on a loaded host)."""
        try:
            keys = await kv_keys(self.tags, "m.>")
        except NotFoundError:
            return []
        manifests = []
        for key in keys:
            found = await self.manifest("sha256:" + key[2:])  # None: deleted since
            if found is not None:
                manifests.append(found)
        return sorted(manifests, key=lambda m: m.created)

    async def tag(self, reference: str, tag: str) -> ImageManifest:
        check_tag(tag)
        digest = await self.resolve(reference)
        manifest = await self.manifest(digest)
        assert manifest is not None
        return await self.record(manifest, [tag])

    async def remove(
        self, reference: str, check: Callable[[ImageManifest], Awaitable[None]] | None = None
    ) -> ImageManifest:
        """Delete an image (its archive, manifest and tags); workers keep what they unpacked until evicted.

        `check` sees the manifest and raises to refuse (the brokers' checked removal); the manifest's delete is a
        compare-and-set on what it saw, so a push that tags the image meanwhile makes it an `ImageError` (try
        again) instead of a removal of an image someone just tagged."""
        digest = await self.resolve(reference)
        key = _manifest_key(digest)
        try:
            entry = await self.tags.get(key)
        except (NotFoundError, KeyError):
            entry = None
        if entry is None or not entry.value:
            raise ImageError(f"no image {reference} in the fleet's store (fauxmad image ls)")
        manifest = msgspec.json.decode(entry.value, type=ImageManifest)
        if check is not None:
            await check(manifest)
        try:
            await self.tags.delete(key, last=entry.revision)
        except KeyWrongLastSequenceError:
            raise ImageError(
                f"image {digest} changed while it was being removed (a push tagged it?): try again"
            ) from None
        for tag in manifest.tags:  # each that still names this image (a tag moved to another since is not touched)
            with contextlib.suppress(NotFoundError, KeyError, KeyWrongLastSequenceError):
                found = await self.tags.get(_tag_key(tag))
                if found is not None and found.value == digest.encode():
                    await self.tags.delete(_tag_key(tag), last=found.revision)
        with contextlib.suppress(ObjectNotFoundError):
            await self.store.delete(digest)
        return manifest


def _reference_problem(reference: str) -> str:
    if not reference:
        return "an empty image reference"
    return f"image {reference!r} is not a reference to the fleet's store: use name:tag or sha256:<64 hex digits>"


async def resolve_image(source: Images | JetStreamContext, reference: str) -> ResolvedImage:
    """The one resolver every door uses: `reference` (`name:tag` or a `sha256:` digest) to the digest to pin
    and its manifest's command, env and workdir. `ImageError` naming the reference when it is malformed,
    no tag has that name, or the store has no such image (a tag whose manifest is gone counts as none).

    It reads the tags bucket only (one or two KV gets): whether the archive itself is whole is checked by
    whoever pulls it (a worker hashes what it unpacks), since a store can be damaged after any door looked."""
    images = source if isinstance(source, Images) else await Images.open(source)
    if is_digest(reference):
        digest = reference
    elif TAG.match(reference):
        try:
            entry = await images.tags.get(_tag_key(reference))
        except (NotFoundError, KeyError):
            entry = None
        if entry is None or not entry.value:
            raise ImageError(f"no image tagged {reference} in the fleet's store (fauxmad image ls)")
        digest = entry.value.decode()
    else:
        raise ImageError(_reference_problem(reference))
    manifest = await images.manifest(digest)
    if manifest is None:
        what = f"image {reference} ({digest})" if digest != reference else f"image {reference}"
        raise ImageError(f"no {what} in the fleet's store (fauxmad image ls)")
    return ResolvedImage(
        reference=reference, digest=digest, cmd=list(manifest.cmd), env=dict(manifest.env), workdir=manifest.workdir
    )
