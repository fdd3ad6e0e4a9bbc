"""The HTTP API's door to images: Fly's `config.image` and `config.init` become a pinned `MachineConfig`.

Fly runs a machine's image with the image's own command unless `init` gives one. A fauxmad machine runs a
command, so this door does what Fly's platform does at create and update: it resolves `config.image` with
`bus.stores.images.resolve_image` (the resolver the CLI, deploys and jobs use: one meaning for a reference) to its
digest, which the machine's config keeps (a worker checks what it pulls against it), and with no
`init.exec`, `init.entrypoint` or `init.cmd` it takes the manifest's command. Errors name Fly's fields
(`config.image`, `config.init.cmd`), never the bus's `config.cmd`.

An image the store does not have is a 400, not a 404: the request's body is wrong, not its path, and a
404 on a machine path tells Fly's clients that the app or machine does not exist.
"""

from __future__ import annotations

from aiohttp import web

from bus.contract.machines import MachineConfig
from bus.stores.images import ImageError, Images, ResolvedImage, resolve_image
from bus.transport.nats_adapter import Nats
from orchestrator.api import types
from orchestrator.api.http import ClientError


class ImageDoor:
    """Resolves references on the API's connection; the store is bound on first use and kept."""

    def __init__(self, nc: Nats) -> None:
        self.nc = nc
        self._images: Images | None = None

    async def resolve(self, reference: str) -> ResolvedImage:
        if self._images is None:
            self._images = await Images.open(self.nc.jetstream())
        return await resolve_image(self._images, reference)


IMAGES: web.AppKey[ImageDoor] = web.AppKey("images", ImageDoor)


async def machine_config(request: web.Request, config: types.FlyMachineConfig) -> MachineConfig:
    """`config` as fauxmad's, its image pinned and its command given or the image's; a 400 naming the field."""
    given = types.command(config.init)
    if not config.image:  # null or "": no image
        if not given:
            raise ClientError(400, "config.image or config.init.cmd is required: there is nothing to run")
        return _checked(config, None, given)
    try:
        image = await request.app[IMAGES].resolve(config.image)
    except ImageError as exc:
        raise ClientError(400, f"config.image: {exc}") from None
    cmd = given or image.cmd
    if not cmd:
        raise ClientError(
            400, f"config.init.cmd is required: image {config.image} ({image.digest}) has no command of its own"
        )
    return _checked(config, image.digest, cmd)


def _checked(config: types.FlyMachineConfig, image: str | None, cmd: list[str]) -> MachineConfig:
    try:
        return types.to_config(config, image=image, cmd=cmd)
    except ValueError as exc:  # msgspec's ValidationError is one
        raise ClientError(400, str(exc)) from None
