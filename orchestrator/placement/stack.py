"""The placement chain, assembled in one place (Nomad's `stack.go`): replies in, a ranked list out.

`rank` sees one auction: the replies gathered from a region's workers (each an `Offer` or a
`Decline`) and the set of workers that were asked and were live by the registry. It judges each
worker exactly once, in this order, and each step says why it comes where it does:

1. Silence. A live worker with no reply is rejected ("no answer within deadline"): there is nothing
   to filter or score, and the broker must not wait for it (immediate-or-cancel).
2. Declines. The worker's own word is the authority on itself (cordoned, overloaded, full), so its
   reason is kept verbatim and nothing else is checked.
3. Region, then the create's own hard rules (`avoid`, and `volume`: the host of a volume it mounts).
   The contract's rule (never place a machine for R elsewhere) and the caller's go before everything
   that only asks "how well"; `volume` before the fit checks, so the volume's host being full reads as
   that host's cpus or memory, and the create's error can say "no room on the volume's host".
4. Consistency, then fit. The numbers are checked before they are used: the fit checks and the
   scorers can then trust capacity > 0 and 0 <= free <= capacity.
5. Scores, only for feasible offers: they are the costly part, and a score of a worker that cannot
   take the machine would only confuse an explanation.

The registry may lag the bus (a worker's first heartbeat not yet seen), so a reply from a worker
outside `live_workers` is still judged; its id is listed in `Ranking.unregistered` for `explain`.
A worker that replied twice is judged on its first reply. For the `p2c` strategy pass the sampled
workers as `live_workers`, so the workers not asked are not reported as silent.

Ties are broken deterministically: more free memory after placement (headroom for the next big
guest), then worker id. A broker may pass its own seeded `random.Random` as `tie_break` instead of
the id, so racing brokers that see identical offers (an empty fleet) do not all herd to one worker.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

import msgspec

from bus.contract.offers import Decline, Offer, OfferRequest, Resources
from orchestrator.placement.ask import Ask
from orchestrator.placement.config import PlacementConfig
from orchestrator.placement.feasible import FILTERS, NO_ANSWER, Filter, filters_for, first_failure
from orchestrator.placement.score import SCORERS, Scorer, free_after, scorers_for, subscores

# Totals are rounded so that equal scores reached by different float paths tie, and the tie-break
# (not 1e-16 of noise) decides; nine digits is far below any meaningful difference in policy.
TOTAL_DIGITS = 9


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A worker that can take the machine: its total, each named (weighted) subscore, what is left."""

    worker_id: str
    total: float
    subscores: dict[str, float]
    free_after: Resources


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    """A worker ruled out: `filter` names the step ("deadline", "declined", "region", "consistent",
    "cpus", "memory"), `reason` says why in words."""

    worker_id: str
    reason: str
    filter: str


class Ranking(msgspec.Struct, frozen=True, kw_only=True):
    """One auction's outcome: candidates best first, rejections by worker id, and the ids of workers
    that replied without being in the live set (the registry may lag)."""

    candidates: list[Candidate]
    rejected: list[Rejection]
    unregistered: list[str] = []


def rank(
    request: Ask | OfferRequest,
    replies: Iterable[Offer | Decline],
    live_workers: AbstractSet[str],
    config: PlacementConfig,
    *,
    tie_break: random.Random | None = None,
) -> Ranking:
    """Judge every worker of the auction once and order the feasible ones, best first.

    `request`: the create's `Ask`, whole (its rules: workers it must not get, filter `avoid`; workers it would
    rather not get, scorer `away`; its volume's worker, filter `volume`), or an `OfferRequest` with no rules.
    See `ask.py`.
    """
    ask = request if isinstance(request, Ask) else Ask.of(request)
    answers = _first_reply_per_worker(replies)
    rejected = [Rejection(worker_id=w, reason=NO_ANSWER, filter="deadline") for w in live_workers - answers.keys()]
    candidates: list[Candidate] = []
    filters, scorers = filters_for(ask), scorers_for(ask)  # once per auction: the same verdicts, fewer calls
    for worker_id in sorted(answers):  # sorted: a seeded tie-break must not depend on arrival order
        verdict = judge(ask, answers[worker_id], config, filters, scorers)
        if isinstance(verdict, Candidate):
            candidates.append(verdict)
        else:
            rejected.append(verdict)
    rejected.sort(key=lambda r: r.worker_id)
    return Ranking(
        candidates=_best_first(candidates, tie_break),
        rejected=rejected,
        unregistered=sorted(answers.keys() - live_workers),
    )


def judge(
    request: Ask,
    reply: Offer | Decline,
    config: PlacementConfig,
    filters: tuple[tuple[str, Filter], ...] = FILTERS,
    scorers: tuple[tuple[str, Scorer | None], ...] = SCORERS,
) -> Candidate | Rejection:
    """One worker's verdict: steps 2 to 5 of the chain described above. `filters` and `scorers`: the chain's,
    or those `filters_for` and `scorers_for` keep for `request` (the same verdict)."""
    if isinstance(reply, Decline):
        return Rejection(worker_id=reply.worker_id, reason=reply.reason or "declined", filter="declined")
    failure = first_failure(request, reply, filters)
    if failure is not None:
        return Rejection(worker_id=reply.worker_id, reason=failure[1], filter=failure[0])
    scores = subscores(request, reply, config, scorers)
    return Candidate(
        worker_id=reply.worker_id,
        total=round(sum(scores.values()), TOTAL_DIGITS),
        subscores=scores,
        free_after=free_after(request, reply),
    )


def _first_reply_per_worker(replies: Iterable[Offer | Decline]) -> dict[str, Offer | Decline]:
    answers: dict[str, Offer | Decline] = {}
    for reply in replies:
        answers.setdefault(reply.worker_id, reply)
    return answers


def _best_first(candidates: list[Candidate], tie_break: random.Random | None) -> list[Candidate]:
    # `candidates` arrive sorted by worker id, so seeded draws are reproducible.
    if tie_break is None:
        return sorted(candidates, key=lambda c: (-c.total, -c.free_after.memory_mb, c.worker_id))
    draw = tie_break.random  # drawn in worker id order, as the candidates come
    keyed = [(-c.total, -c.free_after.memory_mb, draw(), c) for c in candidates]
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]
