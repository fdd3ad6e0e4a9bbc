"""Gathering an auction's offers, one way per strategy; what the auction then ranks.

`Scatter` asks every worker of the region on `fauxmad.v1.offers.<region>` and waits until every live
worker (from the registry) has answered or the deadline passes (when none has answered by then, until the first
answers or a second has passed: silence is not a refusal); creates that arrive while a scatter
with the same question (region, app, guest, image) is out share its answers, so one scatter serves a
burst of creates. `TwoChoices` (p2c) asks just two workers sampled from the registry on their own offer
subjects (O(1) fan-out for huge regions). `Heartbeats` (replica) asks nobody: it reads the workers' last
heartbeats (a worker writes one within a quarter of its heartbeat interval of a reserve: workers/agent/heartbeat.py).

Each discounts what it got by what this broker picked since the offers were taken
(`orchestrator.placement.picks`), so a shared scatter does not send a whole burst to one worker, and
returns it as `Offers`: the offers, the workers the ranking counts as live, how many were asked and how.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode_any, encode
from bus.contract.offers import Offer, OfferReply, OfferRequest
from bus.transport.nats_adapter import Nats
from bus.transport.scatter import Scatterer
from orchestrator.placement.picks import Pick, Picks, discount, offer_from_heartbeat
from orchestrator.replicas.workers import Registry


class Offers(NamedTuple):
    """What one way of gathering got, for the ranking and the outcome's explain."""

    how: str  # the strategy as the outcome says it: scatter, hedged, p2c, replica, p2c>scatter
    replies: list[OfferReply]  # discounted by this broker's picks since they were taken
    considered: AbstractSet[str]  # the workers the ranking counts as live (one that did not answer is named)
    asked: int
    shared: int = 1  # how many creates the scatter answered
    sample: bool = False  # two sampled workers, not the region: if neither can take it, scatter the region


# With live workers in the region and no offer by the deadline, how long since the scatter went out its first offer
# is waited for (a busy host answers late, it has not refused); then the create is ranked on what came
FIRST_OFFER_PATIENCE = 1.0


def _parse_offer(data: bytes) -> OfferReply:
    reply: OfferReply = decode_any(OfferReply, data)
    return reply


def _discounted(reply: OfferReply, picks: list[Pick], app: str) -> OfferReply:
    return discount(reply, picks, app) if picks and isinstance(reply, Offer) else reply


class _Answers(msgspec.Struct, kw_only=True):
    """One scatter's answers, shared by every create that asked the same question while it was out."""

    replies: list[OfferReply]
    sent: float  # perf_counter when the question went out: picks after it are not in the answers
    shared: int = 1


class Scatter:
    """Ask the whole region (strategies scatter and hedged, p2c where it cannot sample, p2c's fallback)."""

    def __init__(self, scatterer: Scatterer, registry: Registry, picks: Picks, deadline: float) -> None:
        self.scatterer = scatterer
        self.registry = registry
        self.picks = picks
        self.deadline = deadline
        self._out: dict[tuple[str, bytes], asyncio.Future[_Answers]] = {}

    async def gather(self, request: OfferRequest, how: str) -> Offers:
        live = self.registry.live_ids(request.region)
        answers = await self._answers(request, expected=len(live))
        replies = [
            _discounted(reply, self.picks.since_scatter(reply.worker_id, answers.sent), request.app)
            for reply in answers.replies
        ]
        return Offers(how, replies, live, len(live), answers.shared)

    async def _answers(self, request: OfferRequest, *, expected: int) -> _Answers:
        """Ask the region, or join the scatter with the same question that is already out."""
        payload = encode(request)
        key = (request.region, payload)
        out = self._out.get(key)
        if out is None:
            out = asyncio.ensure_future(self._once(request.region, payload, expected))
            self._out[key] = out

            def done(future: asyncio.Future[_Answers]) -> None:
                if self._out.get(key) is future:
                    del self._out[key]

            out.add_done_callback(done)
            return await asyncio.shield(out)
        answers = await asyncio.shield(out)
        answers.shared += 1
        return answers

    async def _once(self, region: str, payload: bytes, expected: int) -> _Answers:
        sent = time.perf_counter()
        # a region with live workers none of which answered by the deadline is a busy host, not a refusal: the
        # first offer is waited for a little longer (`bus.transport.scatter`); a region with none fails at once.
        # Picks are kept `window` long, shorter than this wait: a late offer is discounted by fewer of them, and
        # its reserve, which the worker checks against what it holds, stays the authority.
        patience = max(self.deadline, FIRST_OFFER_PATIENCE) if expected else None
        gathered = await self.scatterer.scatter(
            subjects.offers(region),
            payload,
            _parse_offer,
            expected=expected or None,
            deadline=self.deadline,
            patience=patience,
        )
        return _Answers(replies=gathered.replies, sent=sent)


class TwoChoices:
    """Ask two workers of the region drawn in O(1) (p2c): the region's size does not matter."""

    def __init__(self, nc: Nats, registry: Registry, picks: Picks, deadline: float, rng: random.Random) -> None:
        self.nc = nc
        self.registry = registry
        self.picks = picks
        self.deadline = deadline
        self.rng = rng

    async def gather(self, request: OfferRequest, avoid: AbstractSet[str]) -> Offers | None:
        """Two workers' offers; None when the region has too few workers to sample."""
        sent = time.perf_counter()
        sampled = self.registry.sample(request.region, 2, self.rng, avoid)
        if sampled is None:
            return None
        replies = [
            _discounted(reply, self.picks.since_scatter(reply.worker_id, sent), request.app)
            for reply in await self._ask_each(sampled, request)
        ]
        return Offers("p2c", replies, set(sampled), len(sampled), sample=True)

    async def _ask_each(self, worker_ids: list[str], request: OfferRequest) -> list[OfferReply]:
        payload = encode(request)

        async def ask(worker_id: str) -> OfferReply | None:
            try:
                msg = await self.nc.request(subjects.worker_offer(worker_id), payload, timeout=self.deadline)
                return _parse_offer(msg.data)
            except Exception:
                return None

        answers = await asyncio.gather(*[ask(w) for w in worker_ids])
        return [a for a in answers if a is not None]


class Heartbeats:
    """Ask nobody (replica): each live worker's last heartbeat stands for its offer."""

    def __init__(self, registry: Registry, picks: Picks) -> None:
        self.registry = registry
        self.picks = picks

    def gather(self, request: OfferRequest) -> Offers:
        live = self.registry.live_ids(request.region)
        replies = [
            _discounted(
                offer_from_heartbeat(info, request.app, request.image),
                self.picks.since_heartbeat(info.worker_id, info.heartbeat_at),
                request.app,
            )
            for info in self.registry.workers(request.region)
            if info.worker_id in live
        ]
        return Offers("replica", replies, live, 0)
