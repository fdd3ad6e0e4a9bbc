"""Run strategies over one trace and summarize; and the balls-into-bins check of p2c.

Every strategy sees the same seeded trace on a fresh fleet, so the table compares policies, not luck.
Utilization is sampled ten times along the trace; the summary reports the sample where the fleet was
fullest (mean utilization highest), since that is where a policy shows its hot spots and its refusals.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

import msgspec

from bus.contract.machines import Guest
from bus.contract.offers import OfferRequest
from lab.sim.model import Arrival, Departures, Fleet, SimWorker, trace
from lab.sim.placers import placer
from orchestrator.placement.config import PlacementConfig, with_preset
from orchestrator.placement.stack import rank

HOT = 0.9  # a worker this full (cpus booked) is a hot spot


class Spread(msgspec.Struct, frozen=True):
    """CPU utilization across workers at one moment."""

    mean: float
    max: float
    p99: float
    stdev: float
    hot: int  # workers at or above HOT


class StrategyResult(msgspec.Struct, frozen=True):
    strategy: str
    placed: int
    failed: int
    refused_with_room: int  # refusals although a worker of the region had room then (what an omniscient placer fills)
    at_peak: Spread
    max_over_mean: float
    placement_us: float  # wall time per placement decision, this process
    widened: int = 0  # p2c: creates its sample could not take, placed by a scatter of the region


class BallsIntoBins(msgspec.Struct, frozen=True):
    n: int
    max_load_d1: int
    max_load_d2: int
    max_load_d3: int
    theory_d1: float  # ln n / ln ln n
    theory_d2: float  # ln ln n / ln 2 (+ O(1))


class SimReport(msgspec.Struct, frozen=True):
    workers: int
    machines: int
    region_size: int
    seed: int
    results: list[StrategyResult]
    balls: BallsIntoBins | None
    seconds: float


def spread_of(workers: list[SimWorker]) -> Spread:
    used = sorted(w.cpu_utilization for w in workers)
    return Spread(
        mean=round(statistics.fmean(used), 4),
        max=round(used[-1], 4),
        p99=round(used[min(len(used) - 1, int(0.99 * len(used)))], 4),
        stdev=round(statistics.pstdev(used), 4),
        hot=sum(1 for u in used if u >= HOT),
    )


def simulate(
    strategy: str,
    arrivals: list[Arrival],
    fleet_factory: Callable[[], Fleet],
    seed: int,
    config: PlacementConfig | None = None,
) -> tuple[StrategyResult, list[bool]]:
    """One strategy over the trace: the result, and which arrivals it placed (to compare with another)."""
    fleet = fleet_factory()
    place = placer(strategy, config)
    rng = random.Random(seed)
    departures = Departures()
    outcomes: list[bool] = []
    samples: list[Spread] = []
    every = max(1, len(arrivals) // 10)
    spent = 0.0
    with_room = 0
    for i, arrival in enumerate(arrivals):
        for worker_id, app, cpus, memory_mb in departures.until(arrival.at):
            fleet.by_id[worker_id].remove(app, cpus, memory_mb)
        started = time.perf_counter()
        chosen = place(arrival, fleet.regions[arrival.region], rng)
        spent += time.perf_counter() - started
        if chosen is not None:
            chosen.place(arrival.app, arrival.cpus, arrival.memory_mb)
            departures.add(arrival, chosen.worker_id)
        elif any(w.fits(arrival.cpus, arrival.memory_mb) for w in fleet.regions[arrival.region]):
            with_room += 1  # the strategy did not see the room there was (p2c's sample missed it)
        outcomes.append(chosen is not None)
        if (i + 1) % every == 0:
            samples.append(spread_of(fleet.workers))
    peak = max(samples, key=lambda s: s.mean) if samples else spread_of(fleet.workers)
    placed = sum(outcomes)
    return (
        StrategyResult(
            strategy=strategy,
            placed=placed,
            failed=len(outcomes) - placed,
            refused_with_room=with_room,
            at_peak=peak,
            max_over_mean=round(peak.max / peak.mean, 3) if peak.mean else 0.0,
            placement_us=round(1e6 * spent / max(1, len(arrivals)), 1),
            widened=getattr(place, "widened", 0),
        ),
        outcomes,
    )


def balls_into_bins(n: int, seed: int) -> BallsIntoBins:
    """n unit balls into n bins, choosing among d sampled bins with the real chain (preset `spread`, so the
    less loaded bin of the sample scores higher); the maximum load for d = 1, 2, 3."""
    config = with_preset(PlacementConfig(), "spread")
    request = OfferRequest(app="balls", region="r", guest=Guest(cpus=1, memory_mb=1))
    result: dict[int, int] = {}
    for d in (1, 2, 3):
        rng = random.Random(seed + d)
        bins = [SimWorker(f"b{i:06d}", "r", cpus=max(64, n), memory_mb=1 << 30) for i in range(n)]
        for _ in range(n):
            asked = rng.sample(bins, d)
            ranking = rank(
                request, [b.offer("balls") for b in asked], {b.worker_id for b in asked}, config, tie_break=rng
            )
            best = ranking.candidates[0].worker_id
            next(b for b in asked if b.worker_id == best).place("other", 1, 1)  # "other": no spread penalty
        result[d] = max(b.machines for b in bins)
    log_n = math.log(n)
    return BallsIntoBins(
        n=n,
        max_load_d1=result[1],
        max_load_d2=result[2],
        max_load_d3=result[3],
        theory_d1=round(log_n / math.log(log_n), 2),
        theory_d2=round(math.log(log_n) / math.log(2), 2),
    )


# What one strategy's run costs, roughly, relative to a random draw (measured µs per placement, default run)
RELATIVE_COST = {"spread": 60.0, "scatter": 55.0, "binpack": 50.0, "p2c-3": 6.0, "p2c-2": 6.0, "p2c-2-strict": 5.0}


def _one(strategy: str, workers: int, machines: int, region_size: int, seed: int) -> StrategyResult:
    """One strategy in a process of its own: the trace is rebuilt from the seed (the same for all)."""
    arrivals = list(trace(machines, sorted(Fleet(workers, region_size).regions), seed))
    return simulate(strategy, arrivals, lambda: Fleet(workers, region_size), seed)[0]


def run(
    *,
    workers: int,
    machines: int,
    region_size: int,
    seed: int,
    strategies: list[str],
    balls: int | None,
    jobs: int = 1,
    progress: Callable[[str], None] = lambda line: None,
) -> SimReport:
    started = time.perf_counter()
    progress(f"simulating {', '.join(strategies)} ({machines:,} machines on {workers:,} workers, {jobs} at a time)")
    results: list[StrategyResult] = []
    # the strategies are independent: one process each, the longest first (so that the last to finish is a short
    # one: 2 cores ran scatter then spread, 80 s, while the other did binpack and the rest in 45)
    order = sorted(strategies, key=lambda s: -RELATIVE_COST.get(s, 1.0))
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(order)))) as pool:
        futures = [pool.submit(_one, s, workers, machines, region_size, seed) for s in order]
        for future in as_completed(futures):
            result = future.result()
            progress(f"{result.strategy}: done")
            results.append(result)
    results.sort(key=lambda r: strategies.index(r.strategy))
    bins = None
    if balls:
        progress(f"balls into bins: {balls:,} balls, d = 1, 2, 3")
        bins = balls_into_bins(balls, seed)
    return SimReport(
        workers=workers,
        machines=machines,
        region_size=region_size,
        seed=seed,
        results=results,
        balls=bins,
        seconds=round(time.perf_counter() - started, 2),
    )
