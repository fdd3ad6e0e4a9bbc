"""The auction: a broker's call for offers (`fauxmad.v1.offers.<region>`, `worker.<id>.offer`) and a
worker's answer, an offer with its numbers or a decline with a named reason.
"""

from __future__ import annotations

import msgspec

from bus.contract.base import Reply, Request, Token
from bus.contract.machines import Guest


class Resources(Reply):
    cpus: int = 0
    memory_mb: int = 0


class OfferRequest(Request):
    app: Token
    region: Token
    guest: Guest = msgspec.field(default_factory=Guest)
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
