"""Images on the bus (an addition; docs/tutorials/images-and-volumes.md, docs/how-to/secure-fleet.md): the manifest,
and the checked push.

Why a push verb: nats-server's permissions name subjects, they cannot hash bytes. So an identity that may
not be trusted with the image store (a deployer) pushes through the brokers, which check what no
permission can: the archive's bytes hash to the digest that names it, and its tags are its own app's.

- `fauxmad.v1.api.apps.<app>.images.push` (`ImagePushRequest`: the manifest and the tags): if the store
  already holds the digest's object whole, the broker records the manifest and the tags at once (a re-push
  or a `tag`); otherwise it opens an upload and answers its id and the chunk size.
- `fauxmad.v1.api.apps.<app>.images.upload.<upload id>` (`ImageChunk`, in order): the archive's bytes; the
  chunk marked `last` commits: hash checked, object written, manifest and tags recorded, the manifest
  answered. Only the broker that opened the upload listens there; a deployer of another app cannot
  publish there (its permissions name its own app only).
- `fauxmad.v1.api.apps.<app>.images.rm` (`ImageRemoveRequest`): remove one of the app's images (its archive,
  manifest and tags), which no permission could limit to the app's own: the broker checks that the image is the
  app's (it pushed the digest first) and that no other app uses it (tags it, or pins it in its current release).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from bus.contract.base import Reply, Request

DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]
IMAGE_TAG_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}:[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"  # name:tag (the store checks it too)
ImageTag = Annotated[str, msgspec.Meta(pattern=IMAGE_TAG_PATTERN)]
UploadId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
MAX_ARCHIVE = 2 << 30  # 2 GiB


class ImageManifest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What an image is besides its bytes: kept at KV `fauxmad_image_tags` key `m.<hex>`."""

    digest: str
    size: int
    created: float
    cmd: list[str] = []  # the default command (an OCI image's Entrypoint + Cmd)
    env: dict[str, str] = {}  # defaults under the machine's own `env`
    workdir: str = ""  # relative to the image's root: where `cmd` runs
    source: str = ""  # what it was built from (a directory, an OCI layout)
    tags: list[str] = []
    # the app whose deployer pushed it first through the brokers ("": the operator, or an open fleet): only
    # that app may push it again with other defaults (cmd, env, workdir), which every user of the digest gets
    app: str = ""


class ImagePushRequest(Request):
    manifest: ImageManifest
    tags: list[ImageTag] = []  # each `<app>:<tag>` of the subject's app


class ImagePushReply(Reply):
    manifest: ImageManifest | None = None  # set once recorded: nothing more to send
    broker: str = ""  # else: where to send the chunks, `...images.upload.<broker>.<upload>`
    upload: str = ""
    chunk_bytes: int = 0  # the most bytes one chunk may carry


class ImageChunk(Request):
    seq: Annotated[int, msgspec.Meta(ge=0)]
    data: bytes  # base64 in JSON
    last: bool = False  # the archive is complete: check, store, record


class ImageRemoveRequest(Request):
    reference: Annotated[str, msgspec.Meta(max_length=200)]  # `<app>:<tag>` of the subject's app, or a digest


class ImageRemoveReply(Reply):
    manifest: ImageManifest  # what was removed, its tags included
