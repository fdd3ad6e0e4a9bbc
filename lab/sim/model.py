"""The simulated fleet and its workload: workers with bookings, and a seeded trace of machines that arrive,
live a while and leave.

A simulated worker answers an auction the way a real one does: with an `Offer` (capacity, what is free,
how many machines, how many of the app's). Nothing else of a worker matters to placement, so nothing
else is modelled; what a worker does with a machine after placement is the worker's business.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Iterator

import msgspec

from bus.contract.offers import Offer, Resources

# (cpus, memory_mb, weight): mostly small guests, a few big ones, as fleets of apps look
GUEST_MIX: tuple[tuple[int, int, float], ...] = ((1, 256, 0.60), (2, 1024, 0.25), (4, 4096, 0.10), (8, 8192, 0.05))
APPS = 200


class Arrival(msgspec.Struct, frozen=True):
    at: float
    machine: int
    app: str
    region: str
    cpus: int
    memory_mb: int
    leaves_at: float


class SimWorker:
    __slots__ = ("apps", "capacity", "free_cpus", "free_memory", "machines", "region", "worker_id")

    def __init__(self, worker_id: str, region: str, cpus: int, memory_mb: int) -> None:
        self.worker_id = worker_id
        self.region = region
        self.capacity = Resources(cpus=cpus, memory_mb=memory_mb)
        self.free_cpus = cpus
        self.free_memory = memory_mb
        self.machines = 0
        self.apps: Counter[str] = Counter()

    def offer(self, app: str) -> Offer:
        return Offer(
            worker_id=self.worker_id,
            region=self.region,
            capacity=self.capacity,
            free=Resources(cpus=self.free_cpus, memory_mb=self.free_memory),
            machines=self.machines,
            app_machines=self.apps[app],
        )

    def fits(self, cpus: int, memory_mb: int) -> bool:
        return self.free_cpus >= cpus and self.free_memory >= memory_mb

    def place(self, app: str, cpus: int, memory_mb: int) -> None:
        self.free_cpus -= cpus
        self.free_memory -= memory_mb
        self.machines += 1
        self.apps[app] += 1

    def remove(self, app: str, cpus: int, memory_mb: int) -> None:
        self.free_cpus += cpus
        self.free_memory += memory_mb
        self.machines -= 1
        self.apps[app] -= 1

    @property
    def cpu_utilization(self) -> float:
        return 1.0 - self.free_cpus / self.capacity.cpus


class Fleet:
    """`workers` workers in regions of `region_size`, each with `cpus` and `memory_mb`."""

    def __init__(self, workers: int, region_size: int, cpus: int = 16, memory_mb: int = 65536) -> None:
        self.workers = [SimWorker(f"w{i:05d}", f"r{i // region_size:03d}", cpus, memory_mb) for i in range(workers)]
        self.regions: dict[str, list[SimWorker]] = {}
        for worker in self.workers:
            self.regions.setdefault(worker.region, []).append(worker)
        self.by_id = {w.worker_id: w for w in self.workers}


def trace(machines: int, regions: list[str], seed: int, mean_life: float | None = None) -> Iterator[Arrival]:
    """`machines` arrivals, one per time unit on average (Poisson), each living an exponential time with
    mean `mean_life` (default: half the trace, so the fleet fills to roughly half and stays busy)."""
    rng = random.Random(seed)
    life = mean_life if mean_life is not None else machines / 2
    sizes = [(c, m) for c, m, _ in GUEST_MIX]
    weights = [w for _, _, w in GUEST_MIX]
    now = 0.0
    for i in range(machines):
        now += rng.expovariate(1.0)
        cpus, memory_mb = rng.choices(sizes, weights)[0]
        yield Arrival(
            at=now,
            machine=i,
            app=f"app{rng.randrange(APPS)}",
            region=regions[rng.randrange(len(regions))],
            cpus=cpus,
            memory_mb=memory_mb,
            leaves_at=now + rng.expovariate(1.0 / life),
        )


class Departures:
    """Machines to remove when the clock passes their time (a heap)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, str, int, int]] = []

    def add(self, arrival: Arrival, worker_id: str) -> None:
        heapq.heappush(
            self._heap,
            (arrival.leaves_at, arrival.machine, worker_id, arrival.app, arrival.cpus, arrival.memory_mb),
        )

    def until(self, now: float) -> Iterator[tuple[str, str, int, int]]:
        while self._heap and self._heap[0][0] <= now:
            _, _, worker_id, app, cpus, memory_mb = heapq.heappop(self._heap)
            yield worker_id, app, cpus, memory_mb
