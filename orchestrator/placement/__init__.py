"""Placement (flaps' auction, scored like Nomad's scheduler): pure functions from replies to a decision.

The broker scatters an `OfferRequest` over a region, gathers `Offer`s and `Decline`s until the live
workers have answered or a short deadline passes, and hands them here. This package does no I/O: it
filters (`feasible`), scores (`score`), orders (`stack.rank`) and explains (`explain`), so a decision
is reproducible from its inputs, tested without NATS, and served as-is by `placements.simulate`.

One module per stage: `config` (curves and weights), `feasible` (filters, each with a named reason),
`score` (named subscores), `stack` (the chain, assembled in one place), `explain`, `picks` (what a
broker placed that the offers in hand cannot show yet). p2c's O(1) sampling lives with the live-worker
replica (`orchestrator.replicas.workers.Registry.sample`).
"""

from __future__ import annotations

from orchestrator.placement.config import PRESETS, Curve, PlacementConfig, interpolate, with_preset
from orchestrator.placement.explain import Explain, WorkerExplanation, explain
from orchestrator.placement.feasible import FILTERS, NO_ANSWER, Filter
from orchestrator.placement.score import SCORERS, Scorer
from orchestrator.placement.stack import Candidate, Ranking, Rejection, judge, rank

__all__ = [
    "FILTERS",
    "NO_ANSWER",
    "PRESETS",
    "SCORERS",
    "Candidate",
    "Curve",
    "Explain",
    "Filter",
    "PlacementConfig",
    "Ranking",
    "Rejection",
    "Scorer",
    "WorkerExplanation",
    "explain",
    "interpolate",
    "judge",
    "rank",
    "with_preset",
]
