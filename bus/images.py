"""Images: an app's files as one content-addressed archive, stored in JetStream, pulled by workers.

Both sides need the same definitions: the CLI builds and pushes, a worker pulls and verifies, so the
format, the digest and the store's names live here, in the bus.

- An image is a gzip'd tar of a directory, built deterministically: entries sorted, owners 0, mtimes
  0, modes kept (executable or not), no device files, gzip's own timestamp 0. The same tree gives the
  same bytes, so its `sha256:` digest names its content, and a rebuild of an unchanged app is a no-op.
- The archive is an object named by its digest in the object store `fauxmad_images` (JetStream
  chunks it); its manifest (`ImageManifest`: digest, size, created, cmd, env, workdir) and the tags
  (`name:tag` -> digest) are keys of KV `fauxmad_image_tags`: `m.<hex>` and `t.<name>.<tag>`.
- Whoever reads an archive checks its sha256 against the digest it asked for: a store that answers
  other bytes (damaged, or overwritten) is refused with `ImageError`, never unpacked.
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
from pathlib import Path

import msgspec
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig, ObjectStoreConfig, StorageType
from nats.js.errors import BadRequestError, NotFoundError, ObjectNotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from bus import subjects
from bus.jetstream import bind_or_create_kv, place_at_home

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
TAG = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}:[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
MAX_ARCHIVE = 2 << 30  # 2 GiB
PULL_BATCH = 64  # chunks (128 KiB each) per fetch


class ImageError(Exception):
    """An image problem in plain words (unknown reference, digest mismatch, a directory that cannot be packed)."""


class ImageManifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    digest: str
    size: int
    created: float
    cmd: list[str] = []  # the default command (an OCI image's Entrypoint + Cmd)
    env: dict[str, str] = {}  # defaults under the machine's own `env`
    workdir: str = ""  # relative to the image's root: where `cmd` runs
    source: str = ""  # what it was built from (a directory, an OCI layout)
    tags: list[str] = []


def is_digest(reference: str | None) -> bool:
    return reference is not None and DIGEST.match(reference) is not None


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


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
    try:
        return await js.object_store(subjects.IMAGES_STORE)
    except (NotFoundError, BadRequestError):
        pass
    try:
        return await js.create_object_store(
            subjects.IMAGES_STORE,
            place_at_home(
                ObjectStoreConfig(description="image archives, named by their sha256 digest", storage=StorageType.FILE)
            ),
        )
    except BadRequestError:
        return await js.object_store(subjects.IMAGES_STORE)


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
        """Store the archive (unless the store has it already) and its manifest; point `tags` at it."""
        for tag in tags:
            check_tag(tag)
        try:
            info = await self.store.get_info(manifest.digest)
            present = info is not None and info.size == len(data) and not info.deleted
        except ObjectNotFoundError:
            present = False
        if not present:
            await self.store.put(manifest.digest, data)
        known = await self.manifest(manifest.digest)
        merged = sorted(set(tags) | set(known.tags if known else []))
        manifest = msgspec.structs.replace(manifest, tags=merged)
        await self.tags.put(_manifest_key(manifest.digest), msgspec.json.encode(manifest))
        for tag in tags:
            await self.tags.put(_tag_key(tag), manifest.digest.encode())
        return manifest

    async def resolve(self, reference: str) -> str:
        """A digest for `name:tag` or a digest; `ImageError` if there is no such image."""
        if is_digest(reference):
            if await self.manifest(reference) is None:
                raise ImageError(f"no image {reference} in the fleet's store (fauxmad image ls)")
            return reference
        try:
            entry = await self.tags.get(_tag_key(reference))
        except (NotFoundError, KeyError):
            entry = None
        if entry is None or not entry.value:
            raise ImageError(f"no image tagged {reference} (fauxmad image ls)")
        return str(entry.value.decode())

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
        """The object's bytes, fetched 64 chunks a request by a pull consumer on its chunks' subject.

        Not `ObjectStore.get`: it grows a bytes object chunk by chunk (quadratic: 8 MB/s for 50 MB here),
        or hops to a thread per chunk with `writeinto`, and an ordered push consumer paces itself with flow
        control (both about 40 MB/s); this is 145-213 MB/s. Our digest check replaces the store's."""
        try:
            info = await self.store.get_info(name)
        except ObjectNotFoundError:
            raise ImageError(f"no image {name} in the fleet's store") from None
        size = info.size or 0
        if size == 0 or not info.nuid:
            return b""
        buffer = bytearray()
        sub = await self.js.pull_subscribe(
            f"$O.{subjects.IMAGES_STORE}.C.{info.nuid}",
            stream=f"OBJ_{subjects.IMAGES_STORE}",
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=30.0),
        )
        try:
            while len(buffer) < size:
                for msg in await sub.fetch(batch=PULL_BATCH, timeout=10):
                    buffer += msg.data
        finally:
            await sub.unsubscribe()
        return bytes(buffer)

    async def list(self) -> list[ImageManifest]:
        try:
            keys = await self.tags.keys()
        except NotFoundError:
            return []
        manifests = []
        for key in keys:
            if key.startswith("m."):
                found = await self.manifest("sha256:" + key[2:])
                if found is not None:
                    manifests.append(found)
        return sorted(manifests, key=lambda m: m.created)

    async def tag(self, reference: str, tag: str) -> ImageManifest:
        digest = await self.resolve(reference)
        manifest = await self.manifest(digest)
        assert manifest is not None
        await self.tags.put(_tag_key(tag), digest.encode())
        manifest = msgspec.structs.replace(manifest, tags=sorted(set(manifest.tags) | {tag}))
        await self.tags.put(_manifest_key(digest), msgspec.json.encode(manifest))
        return manifest

    async def remove(self, reference: str) -> ImageManifest:
        """Delete an image (its archive, manifest and tags); workers keep what they unpacked until evicted."""
        digest = await self.resolve(reference)
        manifest = await self.manifest(digest)
        assert manifest is not None
        for tag in manifest.tags:
            await self.tags.delete(_tag_key(tag))
        await self.tags.delete(_manifest_key(digest))
        with contextlib.suppress(ObjectNotFoundError):
            await self.store.delete(digest)
        return manifest
