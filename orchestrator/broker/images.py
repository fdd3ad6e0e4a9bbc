"""The brokers' checked image push: what a deployer's images go through, since no permission can hash bytes.

nats-server enforces subjects, so it could let a deployer write the image store, or not; it cannot tell
whether the bytes written under `sha256:<hex>` hash to that name, nor whose tag a manifest serves. Left to
the server, a deployer of `web` rewrote `victim`'s manifest (its default command) or put other bytes under
a digest `victim` runs. So a deployer has no write permission on the store at all (docs/how-to/secure-fleet.md), and
pushes here, on `fauxmad.v1.api.apps.<app>.images.push` (its permissions name its own app only):

- every tag must be `<app>:<tag>` of the subject's app (403 otherwise): an app's tags are its own;
- the archive comes in chunks to this broker (`...images.upload.<broker>.<upload>`, in order, each
  answered), spooled to a temporary file and hashed as it comes; the last chunk commits only if the bytes
  hash to the manifest's digest and are as many as it says (a one-line 400 naming both digests otherwise,
  and nothing is written);
- an object already whole in the store is never rewritten (a re-push or a `tag` sends no bytes at all),
  so nobody changes the bytes under a digest others use;
- a manifest's defaults (cmd, env, workdir), which every user of the digest gets, may be changed only by
  the app that pushed the digest first (`ImageManifest.app`); another app pushing it with other defaults
  is a 409 (with the same defaults it simply adds its own tags). The write is a compare-and-set.

Uploads left idle for `UPLOAD_IDLE` seconds are dropped (their temporary file with them).

A deployer removes its app's images here too (`...images.rm`: nats-server cannot tell whose an image is): only an
image its app owns (pushed the digest first: `ImageManifest.app`), reached by a tag of its own or the digest (403
otherwise), and only while no other app uses it: tags it, or pins it in its current release (409 naming them).
The removal is a compare-and-set on the manifest it checked (`Images.remove`).

The push is audited like any mutating request (as it is answered: an upload opened is a 200), and so is how
its upload ends, once: a record on the upload's subject, as the identity that opened it, with `upload` saying
`accepted` (digest and size stored), `refused` (the caller's fault: nothing stored) or `failed` (the fleet's:
the store refused the write, the upload sat idle, the broker stopped), and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import tempfile
import time
from typing import IO, Any, Literal

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.errors import BadRequest, Conflict, FauxmadError, Forbidden, NoCapacity, NotFound
from bus.contract.images import (
    MAX_ARCHIVE,
    ImageChunk,
    ImageManifest,
    ImagePushReply,
    ImagePushRequest,
    ImageRemoveReply,
    ImageRemoveRequest,
)
from bus.contract.streams import UploadOutcome
from bus.stores.images import DIGEST, TAG, ImageError, Images, check_bytes
from bus.stores.kv_keys import kv_keys
from bus.transport.audit import UNSIGNED, Caller, RequestAudit, current_caller
from bus.transport.nats_adapter import Nats, Subscription
from bus.transport.service import Responder
from orchestrator.broker.releases import current_spec

log = logging.getLogger(__name__)

UPLOAD_IDLE = 60.0  # seconds an upload may wait for its next chunk
MAX_UPLOADS = 16  # at once, per broker
MAX_CHUNK = 4 << 20

Outcome = Literal["accepted", "refused", "failed"]


class Upload:
    """One push's bytes as they come: a temporary file and the hash so far."""

    def __init__(self, app: str, manifest: ImageManifest, tags: list[str], caller: Caller = UNSIGNED) -> None:
        self.app = app
        self.manifest = manifest
        self.tags = tags
        self.caller = caller  # who opened it (the push's signer): its end is recorded as theirs
        self.file: IO[bytes] = tempfile.TemporaryFile(prefix="fauxmad-image-")  # noqa: SIM115 - closed by close()
        self.hash = hashlib.sha256()
        self.size = 0
        self.next = 0
        self.touched = time.monotonic()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()


def _defaults(manifest: ImageManifest) -> tuple[list[str], dict[str, str], str]:
    return manifest.cmd, manifest.env, manifest.workdir


def owner_check(app: str, manifest: ImageManifest) -> Any:
    """What `Images.record` checks against the manifest stored now: other defaults only from its owner."""

    def check(known: ImageManifest | None) -> None:
        if known is None or _defaults(known) == _defaults(manifest) or known.app == app:
            return
        owner = f"app {known.app}" if known.app else "the operator"
        differ = ", ".join(
            f"{name} {mine!r} (stored: {theirs!r})"
            for name, mine, theirs in zip(("cmd", "env", "workdir"), _defaults(manifest), _defaults(known), strict=True)
            if mine != theirs
        )
        raise Conflict(
            f"image {manifest.digest} is {owner}'s and has other defaults: {differ}; push it with the same ones"
            " (a spec's or machine's own cmd and env still apply)"
        )

    return check


class ImageGate:
    """Serves `...images.push` (an endpoint of the broker's service) and this broker's uploads."""

    def __init__(
        self, nc: Nats, images: Images, broker_id: str, audit: RequestAudit | None = None, apps: Any = None
    ) -> None:
        self.nc = nc
        self.images = images
        self.apps = apps  # KV `fauxmad_apps`: which app's current release pins an image (`handle_rm`)
        self.audit = audit  # where an upload's end is recorded (the broker's audit trail)
        self.key = secrets.token_hex(8)  # this broker's token in upload subjects
        self.uploads: dict[str, Upload] = {}
        self.responder = Responder(nc, f"{broker_id}-uploads")  # chunks belong to their audited push
        self._sub: Subscription | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            subjects.api_images_uploads_of(self.key), cb=self.responder.for_subscription(self.on_chunk)
        )
        self._sweeper = asyncio.create_task(self._sweep())

    @property
    def chunk_bytes(self) -> int:
        """Raw bytes per chunk: base64 (4/3) and the JSON around it stay under the server's max payload."""
        return max(64 << 10, min(MAX_CHUNK, (self.nc.max_payload - (16 << 10)) * 3 // 4))

    async def handle_push(self, subject: str, data: bytes) -> ImagePushReply:
        app = subjects.check_token("app", subjects.parse_api_app(subject))
        req = decode(ImagePushRequest, data)
        manifest = req.manifest
        if not DIGEST.match(manifest.digest):
            raise BadRequest(f"manifest.digest {manifest.digest!r} is not sha256:<64 hex digits>")
        if not 0 <= manifest.size <= MAX_ARCHIVE:
            raise BadRequest(f"manifest.size {manifest.size} is not between 0 and {MAX_ARCHIVE} bytes")
        for tag in req.tags:
            if tag.partition(":")[0] != app:
                raise Forbidden(f"tag {tag} is not app {app}'s: a push of app {app} may tag only {app}:<tag>")
        manifest = msgspec.structs.replace(manifest, app=app, tags=[])
        check = owner_check(app, manifest)
        check(await self.images.manifest(manifest.digest))  # refused before any byte is sent
        if await self.images.present(manifest.digest):
            info = await self.images.store.get_info(manifest.digest)
            manifest = msgspec.structs.replace(manifest, size=info.size or 0)
            return ImagePushReply(manifest=await self.images.record(manifest, list(req.tags), check))
        if len(self.uploads) >= MAX_UPLOADS:
            raise NoCapacity(f"this broker holds {MAX_UPLOADS} uploads already: try again shortly")
        upload = secrets.token_hex(16)
        self.uploads[upload] = Upload(app, manifest, list(req.tags), current_caller())
        return ImagePushReply(broker=self.key, upload=upload, chunk_bytes=self.chunk_bytes)

    async def handle_rm(self, subject: str, data: bytes) -> ImageRemoveReply:
        app = subjects.check_token("app", subjects.parse_api_app(subject))
        reference = decode(ImageRemoveRequest, data).reference
        if TAG.match(reference) and reference.partition(":")[0] != app:
            raise Forbidden(f"tag {reference} is not app {app}'s: a deployer of {app} removes only {app}'s images")

        async def check(manifest: ImageManifest) -> None:
            if manifest.app != app:
                owner = f"app {manifest.app}'s" if manifest.app else "the operator's"
                raise Forbidden(f"image {manifest.digest} is {owner}, not app {app}'s: {app} removes only its own")
            users = sorted({tag.partition(":")[0] for tag in manifest.tags} - {app})
            if users:
                tagged = ", ".join(tag for tag in manifest.tags if tag.partition(":")[0] != app)
                raise Conflict(f"image {manifest.digest} is still in use by app {', '.join(users)} (tagged {tagged})")
            pinned = await self._pinned_by(manifest.digest, but=app)
            if pinned:
                raise Conflict(
                    f"image {manifest.digest} is still in use by app {', '.join(pinned)} (its current release runs it)"
                )

        try:
            digest = await self.images.resolve(reference)
        except ImageError as exc:  # malformed, or no such image
            raise NotFound(str(exc)) from None
        try:
            return ImageRemoveReply(manifest=await self.images.remove(digest, check))
        except ImageError as exc:  # removed or re-tagged meanwhile
            raise Conflict(str(exc)) from None

    async def _pinned_by(self, digest: str, *, but: str) -> list[str]:
        """The apps other than `but` whose current release's spec pins `digest` (`image = "sha256:..."`)."""
        if self.apps is None:
            return []
        found = []
        for key in await kv_keys(self.apps, "*.current"):
            name = key.partition(".")[0]
            if name == but:
                continue
            try:
                spec = await current_spec(self.apps, name)
            except Exception as exc:  # a release that cannot be read now: it may pin it (never remove in doubt)
                log.warning("image rm: could not read %s's release: %s", name, exc)
                found.append(name)
                continue
            if spec is not None and spec.image == digest:
                found.append(name)
        return sorted(found)

    async def on_chunk(self, subject: str, data: bytes) -> ImagePushReply:
        name = subject.rsplit(".", 1)[-1]
        upload = self.uploads.get(name)
        if upload is None or upload.app != subjects.parse_api_app(subject):
            raise NotFound(f"no upload {name} here (dropped after {UPLOAD_IDLE:g}s idle, or done): push again")
        try:
            chunk = decode(ImageChunk, data)
            if chunk.seq != upload.next:
                raise BadRequest(f"chunk {chunk.seq} out of order: expected {upload.next}; push again")
            if upload.size + len(chunk.data) > upload.manifest.size:
                raise BadRequest(f"more bytes than manifest.size ({upload.manifest.size}); push again")
            upload.file.write(chunk.data)
            upload.hash.update(chunk.data)
            upload.size += len(chunk.data)
            upload.next += 1
            upload.touched = time.monotonic()
            if not chunk.last:
                return ImagePushReply()
            self.uploads.pop(name, None)
            stored = await self._commit(upload)
        except FauxmadError as exc:  # a 4xx is the caller's (refused), a 5xx the fleet's (failed)
            await self._end(name, upload, exc.code, exc.message)
            raise
        except Exception as exc:
            await self._end(name, upload, 500, f"internal error: {exc!r}")
            raise
        except BaseException:
            self._drop(name)
            upload.close()
            raise
        await self._ended(name, upload, 200, "")
        return ImagePushReply(manifest=stored)

    async def _end(self, name: str, upload: Upload, status: int, reason: str) -> None:
        """The upload is over, unfinished: dropped, and its end recorded."""
        self._drop(name)
        upload.close()
        await self._ended(name, upload, status, reason)

    async def _ended(self, name: str, upload: Upload, status: int, reason: str) -> None:
        if self.audit is None:
            return
        outcome: Outcome = "accepted" if status == 200 else "refused" if status < 500 else "failed"
        subject = subjects.api_images_upload(upload.app, self.key, name)
        said = UploadOutcome(outcome=outcome, digest=upload.manifest.digest, size=upload.size, reason=reason)
        await self.audit.record(subject, upload.caller, status, name, upload=said)

    async def _commit(self, upload: Upload) -> ImageManifest:
        manifest = upload.manifest
        if upload.size != manifest.size:
            raise BadRequest(f"image {manifest.digest}: {upload.size} bytes came, manifest.size says {manifest.size}")
        try:
            check_bytes(manifest.digest, "sha256:" + upload.hash.hexdigest())
        except ImageError as exc:
            raise BadRequest(str(exc)) from None
        upload.file.flush()
        upload.file.seek(0)
        check = owner_check(upload.app, manifest)
        check(await self.images.manifest(manifest.digest))  # again: it may have changed while the bytes came
        await self.images.store_object(manifest.digest, upload.file)
        upload.close()
        return await self.images.record(manifest, upload.tags, check)

    def _drop(self, name: str) -> None:
        upload = self.uploads.pop(name, None)
        if upload is not None:
            upload.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(5)
            now = time.monotonic()
            for name, upload in list(self.uploads.items()):
                if now - upload.touched > UPLOAD_IDLE:
                    log.info("dropping upload %s of app %s: idle for %.0fs", name, upload.app, now - upload.touched)
                    await self._end(name, upload, 504, f"dropped after {UPLOAD_IDLE:g}s without a chunk")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self.responder.drain(2.0)
        for name, upload in list(self.uploads.items()):
            await self._end(name, upload, 503, "the broker stopped before the last chunk")
