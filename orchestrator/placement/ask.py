"""What the chain judges offers against: the request the workers saw, and the create's rules about workers.

Workers answer an `OfferRequest` (app, region, guest, image). A create may also name workers it must not
get (`avoid_workers`: a spare off its primary's host, a drained host) and workers it would rather not get
(`prefer_away`: only if nothing else has room). Those rules concern the broker's choice alone, so they never
travel to the workers; they enter the chain here, as one filter (`avoid`) and one scorer (`away`), and so
appear in `explain` like every other rule (Nomad's `node-reschedule-penalty` is such a scorer). A machine
that mounts a volume (`config.mounts`) can only run on the volume's worker: the broker looks that worker up
and the chain's filter `volume` rules out every other one, by name, in `explain`.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from bus.contract.machines import Guest
from bus.contract.offers import OfferRequest


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    app: str
    region: str
    guest: Guest
    image: str | None = None
    avoid: frozenset[str] = frozenset()
    away: frozenset[str] = frozenset()
    # (volume id, its worker): a machine that mounts a volume runs where the volume is (filter `volume`)
    volume: tuple[str, str] | None = None

    @classmethod
    def of(
        cls,
        request: OfferRequest,
        *,
        avoid: Iterable[str] = (),
        away: Iterable[str] = (),
        volume: tuple[str, str] | None = None,
    ) -> Ask:
        return cls(
            app=request.app,
            region=request.region,
            guest=request.guest,
            image=request.image,
            avoid=frozenset(avoid),
            away=frozenset(away),
            volume=volume,
        )
