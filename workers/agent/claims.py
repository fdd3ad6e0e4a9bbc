"""The idempotency claims of the worker's region, for the fence (workers/lifecycle/fence.py): read and settle.

In a supercluster a region's creates are claimed in the region's own bucket, which is where its workers
look; on one server, the fleet's `fauxmad_idempotency`.
"""

from __future__ import annotations

from bus.contract.codec import decoder, encode
from bus.contract.idempotency import Claim, claim_key
from bus.transport.jetstream import FleetKV
from bus.transport.nats_adapter import KV, KeyNotFoundError, KeyWrongLastSequenceError


class RegionClaims:
    def __init__(self, kv: KV) -> None:
        self.kv = kv

    async def read(self, app: str, key: str) -> tuple[Claim | None, int]:
        try:
            entry = await self.kv.get(claim_key(app, key))
        except KeyNotFoundError:
            return None, 0
        if entry.value is None:  # a delete marker
            return None, 0
        return decoder(Claim).decode(entry.value), int(entry.revision or 0)

    async def settle(self, app: str, key: str, claim: Claim, revision: int) -> bool:
        try:
            await self.kv.update(claim_key(app, key), encode(claim), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True


def region_claims(kv: FleetKV, region: str) -> RegionClaims:
    """The claims of creates in `region` (the worker's): the region's own bucket in a supercluster, else the
    fleet's (`FleetKV.claims`)."""
    return RegionClaims(kv.claims(region))
