"""How the CLI and a deploy write (and remove) an image: in the store directly, or through the brokers' checks.

Why two ways: a deployer may not write the image store (nats-server cannot check that bytes hash to their
name, nor whose tag a manifest serves), so its pushes and tags go to `fauxmad.v1.api.apps.<app>.images.push`
where a broker checks both (`orchestrator.broker.images`). The operator, and anyone on an open fleet, keep
writing the store directly: no broker needed, no bytes relayed. The connection's role (from its credentials)
picks the way, so `fauxmad image build|push|import|tag` and `deploy` with `build =` work the same for both.

Either way the bytes are hashed here first: an archive that is not its manifest's digest is refused before
anything is sent (the broker checks again: a client that skips this gets the same one-line 400).
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client

from bus.contract import subjects
from bus.contract.images import (
    ImageChunk,
    ImageManifest,
    ImagePushReply,
    ImagePushRequest,
    ImageRemoveReply,
    ImageRemoveRequest,
)
from bus.stores.images import TAG, ImageError, Images, check_bytes, check_tag, digest_of
from bus.transport.nats_adapter import role_of
from bus.transport.service import call

PUSH_TIMEOUT = 30.0
COMMIT_TIMEOUT = 300.0  # the last chunk: the broker writes the whole archive into the store


def checked(nc: Client) -> bool:
    """Whether this connection writes images through the brokers: a secure fleet's identity that is not the
    operator (a deployer; other roles are refused there too, by the server or the broker)."""
    role = role_of(nc)
    return role is not None and role != "operator"


def app_of(app: str | None, tags: list[str]) -> str:
    """The app a checked push is for: `app`, else the one name all its tags share."""
    names = {tag.partition(":")[0] for tag in tags}
    if app is not None:
        return subjects.check_token("app", app)
    if len(names) == 1:
        return names.pop()
    raise ImageError("a deployer pushes into its app: tag it APP:TAG (one app) or give --app APP")


async def push_image(
    nc: Client, data: bytes, manifest: ImageManifest, tags: list[str], *, app: str | None = None
) -> ImageManifest:
    """Store `data` with `manifest` and point `tags` at it, the way this connection may."""
    for tag in tags:
        check_tag(tag)
    if not checked(nc):
        return await (await Images.open(nc.jetstream())).push(data, manifest, tags)
    check_bytes(manifest.digest, digest_of(data))
    manifest = msgspec.structs.replace(manifest, size=len(data))
    owner = app_of(app, tags)
    reply = await call(
        nc,
        subjects.api_images_push(owner),
        ImagePushRequest(manifest=manifest, tags=tags),
        ImagePushReply,
        timeout=PUSH_TIMEOUT,
    )
    if reply.manifest is not None:  # the store holds it already: recorded, nothing to send
        return reply.manifest
    subject = subjects.api_images_upload(owner, reply.broker, reply.upload)
    size = max(1, min(reply.chunk_bytes, (nc.max_payload - (16 << 10)) * 3 // 4))
    offset, seq = 0, 0
    while True:
        piece = data[offset : offset + size]
        offset += len(piece)
        last = offset >= len(data)
        answer = await call(
            nc,
            subject,
            ImageChunk(seq=seq, data=piece, last=last),
            ImagePushReply,
            timeout=COMMIT_TIMEOUT if last else PUSH_TIMEOUT,
        )
        if last:
            if answer.manifest is None:
                raise ImageError(f"image {manifest.digest}: the broker took the last chunk without recording it")
            return answer.manifest
        seq += 1


async def tag_image(nc: Client, reference: str, tag: str) -> ImageManifest:
    """Point `tag` at the image `reference` names, the way this connection may."""
    check_tag(tag)
    images = await Images.open(nc.jetstream())
    if not checked(nc):
        return await images.tag(reference, tag)
    digest = await images.resolve(reference)
    manifest = await images.manifest(digest)
    if manifest is None:
        raise ImageError(f"no image {reference} in the fleet's store (fauxmad image ls)")
    reply = await call(
        nc,
        subjects.api_images_push(app_of(None, [tag])),
        ImagePushRequest(manifest=msgspec.structs.replace(manifest, tags=[]), tags=[tag]),
        ImagePushReply,
        timeout=PUSH_TIMEOUT,
    )
    if reply.manifest is None:
        raise ImageError(f"image {reference} ({digest}) is not whole in the store: push it again, then tag it")
    return reply.manifest


async def remove_image(nc: Client, reference: str, *, app: str | None = None) -> ImageManifest:
    """Remove the image `reference` names, the way this connection may: from the store directly (the operator, an
    open fleet), or through the brokers (a deployer: only its app's images no other app uses). `app`: the app whose
    image a digest is (a tag names its own)."""
    if not checked(nc):
        return await (await Images.open(nc.jetstream())).remove(reference)
    if app is None and not TAG.match(reference):
        raise ImageError(f"a deployer removes its app's images: name it APP:TAG, or give --app APP with {reference}")
    owner = app_of(app, [reference] if TAG.match(reference) else [])
    reply = await call(
        nc,
        subjects.api_images_rm(owner),
        ImageRemoveRequest(reference=reference),
        ImageRemoveReply,
        timeout=PUSH_TIMEOUT,
    )
    return reply.manifest
