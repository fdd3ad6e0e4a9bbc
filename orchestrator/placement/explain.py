"""Why a worker won: a `Ranking` flattened into one JSON-friendly record per worker.

This is what `placements.simulate` and a create with `explain` return, so an operator can see every
worker of the auction exactly once: a candidate with its rank, total and subscores, or a rejection
with the filter that ruled it out and its reason. Nothing is recomputed here: the explanation is the
decision itself, so the two can never disagree.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from bus.contract.offers import Resources
from orchestrator.placement.stack import Candidate, Ranking, Rejection

UNREGISTERED_NOTE = "answered but not in the live set (the registry may lag): considered anyway"


class WorkerExplanation(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One worker's part in the auction; fields that do not apply to its outcome are left out."""

    worker_id: str
    outcome: Literal["candidate", "rejected"]
    rank: int | None = None
    total: float | None = None
    subscores: dict[str, float] = {}
    free_after: Resources | None = None
    filter: str | None = None
    reason: str | None = None
    registered: bool = True
    note: str | None = None


class Explain(msgspec.Struct, frozen=True, kw_only=True):
    """Every worker of the auction: candidates best first (rank 1 is the winner), then rejections."""

    winner: str | None
    workers: list[WorkerExplanation]


def explain(ranking: Ranking) -> Explain:
    unregistered = set(ranking.unregistered)
    workers = [_candidate(i, c, c.worker_id not in unregistered) for i, c in enumerate(ranking.candidates, 1)]
    workers += [_rejection(r, r.worker_id not in unregistered) for r in ranking.rejected]
    winner = ranking.candidates[0].worker_id if ranking.candidates else None
    return Explain(winner=winner, workers=workers)


def _candidate(position: int, candidate: Candidate, registered: bool) -> WorkerExplanation:
    return WorkerExplanation(
        worker_id=candidate.worker_id,
        outcome="candidate",
        rank=position,
        total=candidate.total,
        subscores=candidate.subscores,
        free_after=candidate.free_after,
        registered=registered,
        note=None if registered else UNREGISTERED_NOTE,
    )


def _rejection(rejection: Rejection, registered: bool) -> WorkerExplanation:
    return WorkerExplanation(
        worker_id=rejection.worker_id,
        outcome="rejected",
        filter=rejection.filter,
        reason=rejection.reason,
        registered=registered,
        note=None if registered else UNREGISTERED_NOTE,
    )
