"""A deploy's image: build it (`build = "."`) or resolve its tag (`image = "name:tag"`), and pin the digest.

A release stores the spec it ran; pinning the digest there (not the tag, not the directory) is what makes
a rollback restore the exact bytes, and lets every worker check what it pulls against it. A spec without
a `cmd` takes the image's (its manifest's) default command. `image =` goes through `bus.stores.images.resolve_image`,
the resolver the CLI, the HTTP API and jobs use too, so a reference means the same thing at every door.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from bus.stores.image_push import push_image
from bus.stores.images import ImageError, Images, build_archive, is_digest, manifest_for, resolve_image
from bus.transport.nats_adapter import JetStream, connection_of
from orchestrator.apps.spec import AppSpec


async def pin_image(js: JetStream, spec: AppSpec, say: Callable[[str], None] = lambda line: None) -> AppSpec:
    """`spec` with `image` a digest the fleet's store holds (built and pushed first for `build`)."""
    if spec.image is None and spec.build is None:
        return spec
    images = await Images.open(js)
    if spec.build is not None:
        data = build_archive(Path(spec.build))
        manifest = manifest_for(data, cmd=list(spec.cmd), env={}, workdir="", source=spec.build)
        tag = f"{spec.app}:{manifest.digest[7:19]}"
        # the store directly (the operator, an open fleet) or the brokers' checked push (a deployer)
        nc = connection_of(js)  # the deploy hands its js
        assert nc is not None, "a JetStream handle has its connection"
        pushed = await push_image(nc, data, manifest, [tag], app=spec.app)
        say(f"built {spec.build} into {pushed.digest} ({len(data) / 1e6:.2f} MB, tagged {tag})")
        reference = pushed.digest
    else:
        assert spec.image is not None
        reference = spec.image
    resolved = await resolve_image(images, reference)
    if spec.build is None and not is_digest(spec.image):
        say(f"image {spec.image} is {resolved.digest}")
    cmd = list(spec.cmd) or resolved.cmd
    if not cmd:
        raise ImageError(f"{spec.app}: no `cmd` in the spec and none in image {reference}'s manifest")
    return msgspec.structs.replace(spec, image=resolved.digest, build=None, cmd=cmd)
