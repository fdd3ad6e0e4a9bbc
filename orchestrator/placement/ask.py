"""What the chain judges offers against: the request the workers saw, and the create's rules about workers.

Workers answer an `OfferRequest` (app, region, guest, image). A create may also name workers it must not
get (`avoid_workers`: a spare off its primary's host, a drained host) and workers it would rather not get
(`prefer_away`: only if nothing else has room). Those rules concern the broker's choice alone, so they never
travel to the workers; they enter the chain here, as one filter (`avoid`) and one scorer (`away`), and so
appear in `explain` like every other rule (Nomad's `node-reschedule-penalty` is such a scorer). A machine
that mounts a volume (`config.mounts`) can only run on the volume's worker: the broker looks that worker up
and the chain's filter `volume` rules out every other one, by name, in `explain`.

An `Ask` is built once per create (`for_create`) or simulation (`for_simulate`) and passed whole through the
broker's auction (`place -> rank -> _chain`) into the chain (`stack.rank`), as Nomad passes its `SelectOptions`:
the rules (avoid, away, the app's preset, the volume) are written in one struct, not again as loose arguments
at every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from bus.contract.fleet import CreateRequest, Preset, SimulateRequest
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
    preset: Preset | None = None  # the app's `[placement] preset`: the curves its scorers use (None: the broker's)

    @property
    def offer_request(self) -> OfferRequest:
        """What the workers are asked (the rules stay with the broker)."""
        return OfferRequest(app=self.app, region=self.region, guest=self.guest, image=self.image)

    @classmethod
    def for_create(cls, app: str, request: CreateRequest, volume: tuple[str, str] | None = None) -> Ask:
        """A create's ask: its machine's guest and image, its rules, and the volume it mounts (the broker looks
        that up)."""
        return cls(
            app=app,
            region=request.region,
            guest=request.config.guest,
            image=request.config.image,
            avoid=frozenset(request.avoid_workers),
            away=frozenset(request.prefer_away),
            volume=volume,
            preset=request.placement_preset,
        )

    @classmethod
    def for_simulate(cls, request: SimulateRequest) -> Ask:
        return cls.of(request, preset=request.placement_preset)

    @classmethod
    def of(
        cls,
        request: OfferRequest | SimulateRequest,
        *,
        avoid: Iterable[str] = (),
        away: Iterable[str] = (),
        volume: tuple[str, str] | None = None,
        preset: Preset | None = None,
    ) -> Ask:
        return cls(
            app=request.app,
            region=request.region,
            guest=request.guest,
            image=request.image,
            avoid=frozenset(avoid),
            away=frozenset(away),
            volume=volume,
            preset=preset,
        )
