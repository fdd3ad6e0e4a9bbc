"""The auction: ask a region's workers for offers, rank them, reserve on the best. Fill or fail, at once.

1. Gather: `scatter` asks every worker of the region on `fauxmad.v1.offers.<region>` and waits until
   every live worker (from the registry) has answered or the deadline passes; `p2c` asks just two
   workers sampled from the registry on their own offer subjects (O(1) fan-out for huge regions).
2. Rank: the pure filter/score chain in `orchestrator.placement`, every rejection named.
3. Reserve on the best; a refusal (the offer was information, not a promise) moves on to the next.
   `hedged` reserves on the top two at once, keeps the first to succeed and destroys the other.
4. Nothing is queued: if no worker of the region takes it, 503 "no capacity in <region>". A machine
   for a region is never placed in another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Any

import msgspec
from nats.aio.client import Client

from bus import subjects
from bus.codec import decode_any, encode
from bus.errors import FauxmadError, NoCapacity, Unreachable
from bus.messages import (
    CreateRequest,
    DestroyRequest,
    Machine,
    OfferGuest,
    OfferReply,
    OfferRequest,
    ReserveRequest,
)
from bus.scatter import Scatterer
from bus.service import call
from orchestrator.placement import PlacementConfig, Ranking, explain, rank, sample_two
from orchestrator.registry import Registry

log = logging.getLogger(__name__)

STRATEGIES = ("scatter", "p2c", "hedged")


class AuctionConfig(msgspec.Struct, frozen=True, kw_only=True):
    deadline: float = 0.050
    strategy: str = "scatter"
    reserve_timeout: float = 2.0
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)


class Attempt(msgspec.Struct, kw_only=True):
    worker_id: str
    outcome: str


class Outcome(msgspec.Struct, kw_only=True):
    """What an auction did, for `explain`: who was asked, who answered, the ranking, the attempts."""

    region: str
    strategy: str
    asked: int
    answered: int
    gather_ms: float
    ranking: Ranking
    attempts: list[Attempt] = []
    winner: str | None = None

    def explain(self) -> dict[str, Any]:
        summary = explain(self.ranking)
        return {
            "region": self.region, "strategy": self.strategy, "asked": self.asked, "answered": self.answered,
            "gather_ms": round(self.gather_ms, 3), "winner": self.winner, "ranked_first": summary.winner,
            "attempts": msgspec.to_builtins(self.attempts), "workers": msgspec.to_builtins(summary.workers),
        }


def _parse_offer(data: bytes) -> OfferReply:
    reply: OfferReply = decode_any(OfferReply, data)
    return reply


class Auction:
    def __init__(self, nc: Client, scatterer: Scatterer, registry: Registry, config: AuctionConfig,
                 *, rng: random.Random | None = None) -> None:
        self.nc = nc
        self.scatterer = scatterer
        self.registry = registry
        self.config = config
        self.rng = rng or random.Random()
        self._background: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------------------------------
    async def rank(self, app: str, region: str, guest: OfferGuest, image: str | None, strategy: str) -> Outcome:
        request = OfferRequest(app=app, region=region, guest=guest, image=image)
        live = self.registry.live_ids(region)
        started = time.perf_counter()
        if strategy == "p2c" and len(live) > 2:
            asked = sample_two(sorted(live), self.rng)
            replies = await self._ask_each(asked, request)
            considered = set(asked)
        else:
            gathered = await self.scatterer.scatter(
                subjects.offers(region), encode(request), _parse_offer,
                expected=len(live) or None, deadline=self.config.deadline,
            )
            replies, considered = gathered.replies, live
            asked = sorted(live)
        ranking = rank(request, replies, considered, self.config.placement)
        return Outcome(
            region=region, strategy=strategy, asked=len(asked), answered=len(replies),
            gather_ms=(time.perf_counter() - started) * 1000, ranking=ranking,
        )

    async def _ask_each(self, worker_ids: list[str], request: OfferRequest) -> list[OfferReply]:
        payload = encode(request)

        async def ask(worker_id: str) -> OfferReply | None:
            try:
                msg = await self.nc.request(subjects.worker_offer(worker_id), payload, timeout=self.config.deadline)
                return _parse_offer(msg.data)
            except Exception:
                return None

        answers = await asyncio.gather(*[ask(w) for w in worker_ids])
        return [a for a in answers if a is not None]

    # ------------------------------------------------------------------------------------------
    async def place(self, app: str, request: CreateRequest, machine_id: str | None = None) -> tuple[Machine, Outcome]:
        """Reserve a machine in `request.region` (state `created`), or raise 503 at once."""
        strategy = request.strategy or self.config.strategy
        guest = OfferGuest(cpus=request.config.guest.cpus, memory_mb=request.config.guest.memory_mb,
                           cpu_kind=request.config.guest.cpu_kind)
        outcome = await self.rank(app, request.region, guest, request.config.image, strategy)
        reserve = ReserveRequest(app=app, region=request.region, config=request.config, name=request.name,
                                 idempotency_key=request.idempotency_key, id=machine_id)
        avoid = set(request.avoid_workers)
        candidates = [c.worker_id for c in outcome.ranking.candidates if c.worker_id not in avoid]
        for worker_id in sorted(avoid & {c.worker_id for c in outcome.ranking.candidates}):
            outcome.attempts.append(Attempt(worker_id=worker_id, outcome="skipped: avoid_workers"))
        if strategy == "hedged" and len(candidates) >= 2:
            machine = await self._reserve_hedged(candidates, reserve, outcome)
        else:
            machine = await self._reserve_in_order(candidates, reserve, outcome)
        if machine is None:
            raise NoCapacity(self._no_capacity_message(request.region, outcome))
        outcome.winner = machine.worker_id
        return machine, outcome

    async def _reserve_on(self, worker_id: str, reserve: ReserveRequest) -> Machine:
        return await call(self.nc, subjects.worker_machines(worker_id, "reserve"), reserve, Machine,
                          timeout=self.config.reserve_timeout)

    async def _reserve_in_order(
        self, candidates: list[str], reserve: ReserveRequest, outcome: Outcome
    ) -> Machine | None:
        for worker_id in candidates:
            try:
                machine = await self._reserve_on(worker_id, reserve)
            except (NoCapacity, Unreachable) as exc:
                outcome.attempts.append(Attempt(worker_id=worker_id, outcome=f"refused: {exc.message}"))
                continue
            outcome.attempts.append(Attempt(worker_id=worker_id, outcome="reserved"))
            return machine
        return None

    async def _reserve_hedged(self, candidates: list[str], reserve: ReserveRequest, outcome: Outcome) -> Machine | None:
        first, second = candidates[0], candidates[1]
        # distinct ids and no shared idempotency key: the two reservations must not be mistaken for one
        hedge = msgspec.structs.replace(reserve, idempotency_key=None, id=None)
        tasks = {asyncio.create_task(self._reserve_on(w, reserve if w == first else hedge)): w for w in (first, second)}
        winner: Machine | None = None
        pending = set(tasks)
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                worker_id = tasks[task]
                exc = task.exception()
                if exc is not None:
                    message = exc.message if isinstance(exc, FauxmadError) else repr(exc)
                    outcome.attempts.append(Attempt(worker_id=worker_id, outcome=f"refused: {message}"))
                elif winner is None:
                    winner = task.result()
                    outcome.attempts.append(Attempt(worker_id=worker_id, outcome="reserved (hedge won)"))
                else:
                    self._release_later(task.result(), outcome)
        for task in pending:  # the loser: release it whenever it lands
            task.add_done_callback(lambda t: self._release_done(t, outcome))
        if winner is None:
            return await self._reserve_in_order(candidates[2:], reserve, outcome)
        return winner

    def _release_done(self, task: asyncio.Task[Machine], outcome: Outcome) -> None:
        if not task.cancelled() and task.exception() is None:
            self._release_later(task.result(), outcome)

    def _release_later(self, machine: Machine, outcome: Outcome) -> None:
        outcome.attempts.append(Attempt(worker_id=machine.worker_id, outcome="reserved (hedge lost, released)"))
        task = asyncio.create_task(self._destroy_quietly(machine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _destroy_quietly(self, machine: Machine) -> None:
        with contextlib.suppress(Exception):
            await call(self.nc, subjects.worker_machines(machine.worker_id, "destroy"),
                       DestroyRequest(id=machine.id, force=True), Machine, timeout=5)

    @staticmethod
    def _no_capacity_message(region: str, outcome: Outcome) -> str:
        if outcome.asked == 0 and outcome.answered == 0:
            return f"no capacity in {region}: no live workers in that region"
        reasons = sorted({r.reason for r in outcome.ranking.rejected} | {a.outcome for a in outcome.attempts})
        detail = "; ".join(reasons[:4])
        return f"no capacity in {region}" + (f" ({detail})" if detail else "")
