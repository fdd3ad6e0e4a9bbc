"""Placement strategies over the simulated fleet, through the real placement chain.

`scatter` asks every worker of the region and ranks every answer with `orchestrator.placement.rank`
(the filters, scorers and tie-break the brokers use); `p2c-d` samples `d` workers of the region and
ranks those; `binpack` and `spread` are scatter with the presets' curves. Two references are not
fauxmad's: `random` (a uniformly drawn worker that fits: what placement without information does) and
`omniscient` (the feasible worker that would be least utilized after placement, computed from exact
state with no auction: a placer that fails only when nothing in the region fits).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bus.contract.machines import Guest
from bus.contract.offers import OfferRequest
from lab.sim.model import Arrival, SimWorker
from orchestrator.placement.config import PlacementConfig, with_preset
from orchestrator.placement.stack import rank

Placer = Callable[[Arrival, list[SimWorker], random.Random], SimWorker | None]
STRATEGIES = ("scatter", "p2c-2", "p2c-3", "p2c-2-strict", "binpack", "spread", "random", "omniscient")


def _request(arrival: Arrival) -> OfferRequest:
    return OfferRequest(
        app=arrival.app, region=arrival.region, guest=Guest(cpus=arrival.cpus, memory_mb=arrival.memory_mb)
    )


def _ranked(arrival: Arrival, asked: list[SimWorker], config: PlacementConfig, rng: random.Random) -> SimWorker | None:
    by_id = {w.worker_id: w for w in asked}
    ranking = rank(_request(arrival), [w.offer(arrival.app) for w in asked], by_id.keys(), config, tie_break=rng)
    return by_id[ranking.candidates[0].worker_id] if ranking.candidates else None


def scatter(config: PlacementConfig) -> Placer:
    def place(arrival: Arrival, region: list[SimWorker], rng: random.Random) -> SimWorker | None:
        return _ranked(arrival, region, config, rng)

    return place


class P2C:
    """The brokers' p2c: `d` distinct workers sampled and ranked; when none of them can take the machine, a
    scatter of the whole region (as the broker does), counted in `widened`."""

    def __init__(self, d: int, config: PlacementConfig, *, widen: bool = True) -> None:
        self.d, self.config, self.widen = d, config, widen
        self.widened = 0

    def __call__(self, arrival: Arrival, region: list[SimWorker], rng: random.Random) -> SimWorker | None:
        chosen = _ranked(arrival, rng.sample(region, min(self.d, len(region))), self.config, rng)
        if chosen is None and self.widen:
            self.widened += 1
            chosen = _ranked(arrival, region, self.config, rng)
        return chosen


def uniform(arrival: Arrival, region: list[SimWorker], rng: random.Random) -> SimWorker | None:
    fitting = [w for w in region if w.fits(arrival.cpus, arrival.memory_mb)]
    return fitting[rng.randrange(len(fitting))] if fitting else None


def omniscient(arrival: Arrival, region: list[SimWorker], rng: random.Random) -> SimWorker | None:
    best: SimWorker | None = None
    best_free = -1.0
    for worker in region:
        if worker.fits(arrival.cpus, arrival.memory_mb):
            free = (worker.free_cpus - arrival.cpus) / worker.capacity.cpus
            if free > best_free:
                best, best_free = worker, free
    return best


def placer(name: str, config: PlacementConfig | None = None) -> Placer:
    base = config or PlacementConfig()
    if name == "scatter":
        return scatter(base)
    if name.startswith("p2c-"):  # p2c-2, p2c-3; p2c-2-strict: no scatter when the sample is full
        d, _, strict = name.removeprefix("p2c-").partition("-")
        return P2C(int(d), base, widen=strict != "strict")
    if name in ("binpack", "spread"):
        return scatter(with_preset(base, name))
    if name == "random":
        return uniform
    if name == "omniscient":
        return omniscient
    raise ValueError(f"unknown strategy {name!r}: use {', '.join(STRATEGIES)}")
