"""The auction: a broker's call for offers (`fauxmad.v1.offers.<region>`, `worker.<id>.offer`) and a
worker's answer, an offer with its numbers or a decline with a named reason.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from bus.contract.base import Reply, Request, Token
from bus.contract.machines import Sandbox


class Resources(Reply):
    cpus: int = 0
    memory_mb: int = 0


class OfferGuest(Request):
    cpus: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    memory_mb: Annotated[int, msgspec.Meta(gt=0, le=16 * 1024 * 1024)] = 256
    cpu_kind: Literal["shared", "performance"] = "shared"
    sandbox: Sandbox = "none"  # addition


class OfferRequest(Request):
    app: Token
    region: Token
    guest: OfferGuest = msgspec.field(default_factory=OfferGuest)
    image: str | None = None
    request_id: str | None = None


class Offer(Reply, tag="offer", tag_field="type"):
    worker_id: str
    region: str
    capacity: Resources
    free: Resources
    image_cached: bool = False
    machines: int = 0
    load: float = 0.0
    app_machines: int = 0
    sandboxes: list[str] = []  # addition: the sandboxes this worker can run besides "none" (e.g. ["bwrap"])


class Decline(Reply, tag="decline", tag_field="type"):
    worker_id: str
    reason: str
    region: str = ""
    free: Resources | None = None


OfferReply = Offer | Decline
