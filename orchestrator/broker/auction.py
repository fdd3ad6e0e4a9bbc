"""The auction: ask a region's workers for offers, rank them, reserve on the best. Fill or fail, at once.

1. Gather (`orchestrator.broker.gather`, one way per strategy): `scatter` (and `hedged`) asks every
   worker of the region and shares its answers with the creates that ask the same meanwhile; `p2c`
   asks just two workers sampled from the registry (O(1) fan-out for huge regions); `replica` asks
   nobody: it ranks the workers' last heartbeats, so a create costs one round trip to the chosen worker.
   Offers of every kind are discounted by what this broker picked since they were taken.
2. Rank: the pure filter/score chain in `orchestrator.placement`, every rejection named, applied to
   what was gathered. When neither of p2c's two can take the machine, the region is then scattered and
   ranked before any 503 (`p2c>scatter`).
3. Reserve on the best; a refusal (the offer was information, not a promise) moves on to the next.
   `hedged` reserves on the top two at once, keeps the first to succeed and destroys the other.
   A timeout is not a refusal: the worker may have reserved. Every reserve names the machine id the
   broker chose and a time (`expires_at`) after which the worker must not commit it; after a timeout
   the broker waits until that time has passed and asks again with an already expired reserve (a
   probe). The worker runs the probe after the original in its one writer, so the answer is final:
   the machine (it was reserved) or 504 (it was not, and never will be). Only then is the next worker
   tried; a worker that does not answer the probe either leaves the create's outcome unknown: 504,
   and the caller's retry with the same idempotency key asks that worker again.
4. Nothing is queued: if no worker of the region takes it, 503 "no capacity in <region>". A machine
   for a region is never placed in another.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import random
import time
import typing
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.errors import DeadlineExceeded, FauxmadError, NoCapacity, Unanswered, Unreachable
from bus.contract.fleet import CreateRequest, Strategy
from bus.contract.ids import new_machine_id
from bus.contract.machines import DestroyRequest, Machine, ReserveRequest
from bus.contract.offers import OfferRequest
from bus.contract.streams import AuditRecord
from bus.transport.jetstream import MAX_CLOCK_SKEW
from bus.transport.nats_adapter import Nats
from bus.transport.scatter import Scatterer
from bus.transport.service import call
from orchestrator.broker.gather import Heartbeats, Offers, Scatter, TwoChoices
from orchestrator.placement import PlacementConfig, Ranking, explain, rank, with_preset
from orchestrator.placement.ask import Ask
from orchestrator.placement.picks import Pick, Picks
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)

STRATEGIES: tuple[str, ...] = typing.get_args(Strategy)

BeforeReserve = Callable[[str], Awaitable[None]]


# How far apart the clocks of a broker and a worker may be: a broker waits this long past a reserve's
# `expires_at` before it trusts a probe's "not reserved". NTP keeps hosts within milliseconds; a worker further off
# its server's clock than this refuses every reserve (`bus.transport.jetstream.MAX_CLOCK_SKEW`, the same number)
CLOCK_SKEW = MAX_CLOCK_SKEW


class AuctionConfig(msgspec.Struct, frozen=True, kw_only=True):
    deadline: float = 0.050
    strategy: str = "scatter"
    reserve_timeout: float = 2.0
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)


class OutcomeUnknown(DeadlineExceeded):
    """A worker took a reserve and then answered neither it nor the probe: it may hold the machine."""

    def __init__(self, workers: list[str], machine_id: str) -> None:
        super().__init__(
            f"worker {', '.join(workers)} did not answer whether it reserved machine {machine_id}: "
            "the create's outcome is unknown; retry with the same idempotency key"
        )
        self.workers = workers
        self.machine_id = machine_id


class NoRoomOnVolumeHost(NoCapacity):
    """The create mounts a volume and the volume's worker cannot take the machine (Fly's volume-scoped
    capacity error): other workers may have room, but the machine must run where its volume is."""


async def _no_volume(app: str, request: CreateRequest) -> tuple[str, str] | None:
    return None


def volume_host_message(volume: tuple[str, str], outcome: Outcome) -> str:
    volume_id, worker_id = volume
    reasons = [r.reason for r in outcome.ranking.rejected if r.worker_id == worker_id]
    reasons += [a.outcome for a in outcome.attempts if a.worker_id == worker_id]
    detail = "; ".join(reasons[:3]) or "it did not offer"
    return f"no room on the volume's host: volume {volume_id} is on worker {worker_id} ({detail})"


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
    shared: int = 1  # how many creates the scatter answered (it is shared by creates that arrive meanwhile)

    def kept(self, chosen: str, top: int = 3) -> dict[str, Any]:
        """The short explanation a machine keeps (in its `created` event) of why it went to `chosen`:
        the best few candidates and `chosen` with their subscores, rejections counted by filter, the
        attempts before it. Short, because the worker writes it with the machine's record."""
        ranked = self.ranking.candidates
        shown = [(i, c) for i, c in enumerate(ranked, 1) if i <= top or c.worker_id == chosen]
        rejected: dict[str, int] = {}
        for rejection in self.ranking.rejected:
            rejected[rejection.filter] = rejected.get(rejection.filter, 0) + 1
        return {
            "strategy": self.strategy,
            "asked": self.asked,
            "answered": self.answered,
            "gather_ms": round(self.gather_ms, 3),
            "shared": self.shared,
            "chosen": chosen,
            "candidates": [
                {"worker_id": c.worker_id, "rank": i, "total": c.total, "subscores": c.subscores} for i, c in shown
            ],
            "feasible": len(ranked),
            "rejected": rejected,
            "attempts": msgspec.to_builtins(self.attempts),
        }

    def explain(self) -> dict[str, Any]:
        summary = explain(self.ranking)
        return {
            "region": self.region,
            "strategy": self.strategy,
            "asked": self.asked,
            "answered": self.answered,
            "gather_ms": round(self.gather_ms, 3),
            "shared": self.shared,
            "winner": self.winner,
            "ranked_first": summary.winner,
            "attempts": msgspec.to_builtins(self.attempts),
            "workers": msgspec.to_builtins(summary.workers),
        }


def _epoch(stamp: str) -> float:
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return time.time()


class Auction:
    def __init__(
        self,
        nc: Nats,
        scatterer: Scatterer,
        registry: Registry,
        config: AuctionConfig,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.nc = nc
        self.registry = registry
        self.config = config
        self.rng = rng or random.Random()
        # a pick matters to scatters out when it was made: none is out longer than the deadline
        self.picks = Picks(clock=time.perf_counter, window=max(0.25, 2 * config.deadline))
        self._scatter = Scatter(scatterer, registry, self.picks, config.deadline)
        self._two = TwoChoices(nc, registry, self.picks, config.deadline, self.rng)
        self._heartbeats = Heartbeats(registry, self.picks)
        self._background: set[asyncio.Task[None]] = set()
        # (volume id, worker) of the volume a create mounts, or None: the broker looks it up
        # (docs/tutorials/images-and-volumes.md)
        self.volume_host: Callable[[str, CreateRequest], Awaitable[tuple[str, str] | None]] = _no_volume

    # ------------------------------------------------------------------------------------------
    async def rank(self, ask: Ask, strategy: str) -> Outcome:
        """Gather the region's offers the way `strategy` says, then rank them with the placement chain."""
        request = ask.offer_request
        if ask.volume is not None and strategy == "p2c":
            strategy = "scatter"  # two sampled workers would rarely include the volume's: ask the region
        config = with_preset(self.config.placement, ask.preset)
        started = time.perf_counter()
        offers = await self._gather(request, strategy, ask.avoid)
        ranking = self._chain(ask, offers, config)
        if offers.sample and not ranking.candidates:
            # Neither sampled worker can take it, but the region may have room: one full look before a 503.
            # (`fauxmad sim`: without this, p2c refused 0.9% of 100,000 creates while their region had room.)
            offers = await self._scatter.gather(request, "p2c>scatter")
            ranking = self._chain(ask, offers, config)
        return Outcome(
            region=ask.region,
            strategy=offers.how,
            asked=offers.asked,
            answered=len(offers.replies),
            gather_ms=(time.perf_counter() - started) * 1000,
            ranking=ranking,
            shared=offers.shared,
        )

    async def _gather(self, request: OfferRequest, strategy: str, avoid: frozenset[str]) -> Offers:
        if strategy == "p2c":
            sampled = await self._two.gather(request, avoid)
            if sampled is not None:
                return sampled
            # a region too small to sample: scattered, still called p2c
        elif strategy == "replica":
            return self._heartbeats.gather(request)
        return await self._scatter.gather(request, strategy)

    def _chain(self, ask: Ask, offers: Offers, config: PlacementConfig) -> Ranking:
        """The placement chain over what was gathered: filters (each rejection named), scorers, tie-break."""
        return rank(ask, offers.replies, offers.considered, config, tie_break=self.rng)

    # ------------------------------------------------------------------------------------------
    def reserve_request(
        self, app: str, request: CreateRequest, machine_id: str | None = None, not_after: float | None = None
    ) -> ReserveRequest:
        return ReserveRequest(
            app=app,
            region=request.region,
            config=request.config,
            name=request.name,
            idempotency_key=request.idempotency_key,
            id=machine_id or new_machine_id(),
            expires_at=not_after,
        )

    async def place(
        self,
        app: str,
        request: CreateRequest,
        machine_id: str | None = None,
        not_after: float | None = None,
        before_reserve: BeforeReserve | None = None,
        audit: AuditRecord | None = None,
    ) -> tuple[Machine, Outcome]:
        """Reserve a machine in `request.region` (state `created`; `started` unless the create says
        `skip_launch`: the worker starts what it reserves, in the same request), or raise 503 at once.

        `not_after` (epoch seconds): no reserve of this placement may be committed after it.
        `before_reserve(worker_id)` runs before each reserve is sent (an idempotent create records there
        which workers may hold its machine); if it raises, that reserve is not sent.
        `audit`: the create's audit record, which the worker keeps in the machine's `created` event.
        """
        strategy = request.strategy or self.config.strategy
        volume = await self.volume_host(app, request)
        outcome = await self.rank(Ask.for_create(app, request, volume), strategy)
        # one leg: the worker starts what it reserves, except for a hedge (the loser would start for nothing)
        launch = not request.skip_launch and strategy != "hedged"
        reserve = msgspec.structs.replace(
            self.reserve_request(app, request, machine_id, not_after), launch=launch, audit=audit
        )
        candidates = [c.worker_id for c in outcome.ranking.candidates]  # `avoid` is a filter of the chain
        if strategy == "hedged" and len(candidates) >= 2:
            machine = await self._reserve_hedged(candidates, reserve, outcome, before_reserve)
        else:
            machine = await self._reserve_in_order(candidates, reserve, outcome, before_reserve)
        if machine is None and volume is not None:
            raise NoRoomOnVolumeHost(volume_host_message(volume, outcome))
        if machine is None:
            raise NoCapacity(self._no_capacity_message(request.region, outcome))
        outcome.winner = machine.worker_id
        return machine, outcome

    async def _reserve_on(self, worker_id: str, reserve: ReserveRequest) -> Machine:
        """Reserve on one worker; after a timeout, find out for sure whether it reserved (see the top)."""
        timeout = self.config.reserve_timeout
        expires_at = time.time() + timeout
        if reserve.expires_at is not None:
            expires_at = min(expires_at, reserve.expires_at)
        attempt = msgspec.structs.replace(reserve, expires_at=expires_at)
        try:
            return await call(
                self.nc, subjects.worker_machines(worker_id, "reserve"), attempt, Machine, timeout=timeout
            )
        except Unanswered:
            found = await self.probe(worker_id, attempt)
            if found is None:
                raise NoCapacity(f"worker {worker_id} did not answer in time (it reserved nothing)") from None
            return found

    async def probe(self, worker_id: str, reserve: ReserveRequest) -> Machine | None:
        """The machine if `worker_id` reserved it, `None` if it did not and never will; 504 if it won't say."""
        assert reserve.id is not None
        wait = (reserve.expires_at or 0.0) + CLOCK_SKEW - time.time()
        if wait > 0:
            await asyncio.sleep(wait)
        expired = msgspec.structs.replace(reserve, expires_at=0.0)  # can find the machine, never reserve it
        subject = subjects.worker_machines(worker_id, "reserve")
        deadline = time.perf_counter() + self.config.reserve_timeout
        while True:
            try:
                return await call(self.nc, subject, expired, Machine, timeout=self.config.reserve_timeout)
            except DeadlineExceeded:
                return None
            except Unanswered:
                raise OutcomeUnknown([worker_id], reserve.id) from None
            except Unreachable:
                # nobody listens right now (the worker is reconnecting): that says nothing of what it holds
                if time.perf_counter() > deadline:
                    raise OutcomeUnknown([worker_id], reserve.id) from None
                await asyncio.sleep(0.05)

    async def find(self, workers: list[str], reserve: ReserveRequest) -> tuple[Machine | None, list[str], list[str]]:
        """Ask each worker (at once) whether it holds the machine of `reserve`, whose reserves have all
        expired. Returns the machine if one does, the live workers that would not say, and the silent ones
        whose heartbeat has expired (gone: the caller fences them, see bus/contract/idempotency.py)."""

        async def one(worker_id: str) -> Machine | None:
            return await self.probe(worker_id, reserve)

        answers = await asyncio.gather(*[one(w) for w in workers], return_exceptions=True)
        found = next((a for a in answers if isinstance(a, Machine)), None)
        silent = [w for w, a in zip(workers, answers, strict=True) if isinstance(a, OutcomeUnknown)]
        region_live = self.registry.live_ids(reserve.region)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, FauxmadError):
                raise answer
        # a worker whose heartbeat has expired is not waited for: it is fenced instead (docs/explanation/faults.md)
        return found, [w for w in silent if w in region_live], [w for w in silent if w not in region_live]

    async def _reserve_in_order(
        self,
        candidates: list[str],
        reserve: ReserveRequest,
        outcome: Outcome,
        before_reserve: BeforeReserve | None = None,
    ) -> Machine | None:
        for worker_id in candidates:
            pick = self._note(worker_id, reserve)  # before any await: the next create ranks without it
            try:
                await _recorded(before_reserve, worker_id)
            except BaseException:
                self.picks.drop(pick)
                raise
            try:
                machine = await self._reserve_on(
                    worker_id, msgspec.structs.replace(reserve, placement=outcome.kept(worker_id))
                )
            except OutcomeUnknown:
                raise  # the pick stays (the worker may hold the machine) until the horizon forgets it
            except (NoCapacity, Unreachable, DeadlineExceeded) as exc:  # refusals: nothing was reserved there
                self.picks.drop(pick)
                outcome.attempts.append(Attempt(worker_id=worker_id, outcome=f"refused: {exc.message}"))
                continue
            except BaseException:
                self.picks.drop(pick)
                raise
            self.picks.reserved(pick, _epoch(machine.created_at))
            outcome.attempts.append(Attempt(worker_id=worker_id, outcome="reserved"))
            return machine
        return None

    def _note(self, worker_id: str, reserve: ReserveRequest) -> Pick:
        guest = reserve.config.guest
        return self.picks.note(worker_id, reserve.app, guest.cpus, guest.memory_mb)

    async def _reserve_hedged(
        self,
        candidates: list[str],
        reserve: ReserveRequest,
        outcome: Outcome,
        before_reserve: BeforeReserve | None = None,
    ) -> Machine | None:
        first, second = candidates[0], candidates[1]
        picks = {w: self._note(w, reserve) for w in (first, second)}  # before any await, as in _reserve_in_order
        try:
            await _recorded(before_reserve, first)  # the hedge has its own id and no key: nothing to record for it
        except BaseException:
            for pick in picks.values():
                self.picks.drop(pick)
            raise
        # distinct ids and no shared idempotency key: the two reservations must not be mistaken for one
        hedge = msgspec.structs.replace(reserve, idempotency_key=None, id=new_machine_id())
        tasks = {
            asyncio.create_task(
                self._reserve_on(
                    w, msgspec.structs.replace(reserve if w == first else hedge, placement=outcome.kept(w))
                )
            ): w
            for w in (first, second)
        }
        winner: Machine | None = None
        pending = set(tasks)
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                worker_id = tasks[task]
                exc = task.exception()
                if exc is not None:
                    self.picks.drop(picks[worker_id])
                    message = exc.message if isinstance(exc, FauxmadError) else repr(exc)
                    outcome.attempts.append(Attempt(worker_id=worker_id, outcome=f"refused: {message}"))
                elif winner is None:
                    winner = task.result()
                    self.picks.reserved(picks[worker_id], _epoch(winner.created_at))
                    outcome.attempts.append(Attempt(worker_id=worker_id, outcome="reserved (hedge won)"))
                else:
                    self.picks.drop(picks[worker_id])
                    self._release_later(task.result(), outcome)
        for task in pending:  # the loser: release it whenever it lands
            self.picks.drop(picks[tasks[task]])
            task.add_done_callback(lambda t: self._release_done(t, outcome))
        if winner is None:
            return await self._reserve_in_order(candidates[2:], reserve, outcome, before_reserve)
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
            await call(
                self.nc,
                subjects.worker_machines(machine.worker_id, "destroy"),
                DestroyRequest(id=machine.id, force=True),
                Machine,
                timeout=5,
            )

    @staticmethod
    def _no_capacity_message(region: str, outcome: Outcome) -> str:
        if outcome.asked == 0 and outcome.answered == 0:
            return f"no capacity in {region}: no live workers in that region"
        reasons = sorted({r.reason for r in outcome.ranking.rejected} | {a.outcome for a in outcome.attempts})
        detail = "; ".join(reasons[:4])
        return f"no capacity in {region}" + (f" ({detail})" if detail else "")


async def _recorded(before_reserve: BeforeReserve | None, worker_id: str) -> None:
    """Run `before_reserve(worker_id)`. Its store not answering (a JetStream stream's leader being elected) is an
    outage, not a lack of capacity: it is raised as `Unreachable` (502, retry soon; the retry with the same
    idempotency key finds out what was written), never counted as this worker's refusal (a 503 "no capacity")."""
    if before_reserve is None:
        return
    try:
        await before_reserve(worker_id)
    except Unreachable as exc:  # Unanswered included: the write may have happened, the retry finds out
        raise Unreachable(exc.message) from None
