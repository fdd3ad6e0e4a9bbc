"""What a broker placed that the numbers in hand do not show yet, and offers from the heartbeat replica.

Offers are a snapshot. When one scatter answers a batch of creates, or when the offers come from the
replica of the workers' heartbeats (strategy `replica`), the machines this broker has just placed are
not in them: ranking the next create on those numbers would send every create of a batch to the same
best worker. So the broker notes each pick before it reserves, and ranks on the offers less the picks
they cannot show: free resources less the guests, one machine more, one more of the app's. The
worker's reserve stays the authority (it re-checks in LMDB); this only keeps the ranking honest
between snapshots.

Which picks an offer cannot show:
- a scattered offer: the picks noted after the scatter was sent (broker clock, `noted`);
- a heartbeat: the picks not yet reserved, and those the worker reserved after it wrote the heartbeat
  (worker clock: the machine's `created_at` against the heartbeat's `heartbeat_at`).
Picks are dropped when their reserve fails, and forgotten once no offer can still need them (see
`Picks`), so the lists a create reads stay a few entries long.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Decline, Offer, OfferReply, Resources

SHOWN_AFTER = 0.5  # seconds between a reserve and the first heartbeat (worker clock) trusted to show it
PENDING = math.inf  # the `reserved_at` of a pick whose reserve has not answered yet


@dataclass(slots=True, eq=False)
class Pick:
    worker_id: str
    app: str
    cpus: int
    memory_mb: int
    noted: float  # broker's monotonic clock, when the pick was made
    reserved_at: float = PENDING  # worker's clock: the machine's created_at, once reserved


class Picks:
    """The picks of one broker, by worker, oldest first; see the module docstring.

    Kept short, since every create reads them: a pick goes once no offer can still need it, that is once it
    is older than `window` (longer than any scatter is out) and a heartbeat of its worker has shown it, or
    after `horizon` whatever happened (a reserve whose outcome stayed unknown, a broker that never ranks
    from heartbeats).
    """

    def __init__(self, *, clock: Callable[[], float], window: float = 0.25, horizon: float = 10.0) -> None:
        self.clock = clock
        self.window = window
        self.horizon = horizon
        self._by_worker: dict[str, deque[Pick]] = {}
        self._shown_until: dict[str, float] = {}  # per worker: the newest heartbeat seen (worker clock)

    def note(self, worker_id: str, app: str, cpus: int, memory_mb: int) -> Pick:
        now = self.clock()
        pick = Pick(worker_id=worker_id, app=app, cpus=cpus, memory_mb=memory_mb, noted=now)
        picks = self._by_worker.setdefault(worker_id, deque())
        self._forget_old(worker_id, picks, now)
        picks.append(pick)
        return pick

    def _forget_old(self, worker_id: str, picks: deque[Pick], now: float) -> None:
        shown_until = self._shown_until.get(worker_id, -math.inf)
        while picks:
            oldest = picks[0]
            age = now - oldest.noted
            if age > self.horizon or (age > self.window and oldest.reserved_at <= shown_until):
                picks.popleft()
            else:
                return

    def reserved(self, pick: Pick, at: float) -> None:
        pick.reserved_at = at

    def drop(self, pick: Pick) -> None:
        picks = self._by_worker.get(pick.worker_id)
        if picks is not None and pick in picks:
            picks.remove(pick)

    def workers_of(self, app: str) -> set[str]:
        """The workers this broker placed a machine of `app` on lately (within `horizon`): a listing reads
        them, since the routing index may not show a machine the moment its create returns."""
        return {worker_id for worker_id, picks in self._by_worker.items() if any(p.app == app for p in picks)}

    def since_scatter(self, worker_id: str, sent: float) -> list[Pick]:
        """Picks a scattered offer cannot show: noted after the scatter was sent at `sent` (the newest last,
        so only those are read)."""
        picks = self._by_worker.get(worker_id)
        if not picks:
            return []
        after: list[Pick] = []
        for pick in reversed(picks):
            if pick.noted <= sent:
                break
            after.append(pick)
        return after

    def since_heartbeat(self, worker_id: str, heartbeat_at: float) -> list[Pick]:
        """Picks a heartbeat written at `heartbeat_at` (worker clock) cannot show."""
        if heartbeat_at - SHOWN_AFTER > self._shown_until.get(worker_id, -math.inf):
            self._shown_until[worker_id] = heartbeat_at - SHOWN_AFTER
        picks = self._by_worker.get(worker_id)
        if not picks:
            return []
        # a heartbeat read its numbers a moment before it was stamped, perhaps while the reserve was being
        # committed: only a heartbeat well after the reserve surely shows it (counting a pick twice for a
        # moment only makes the worker look fuller)
        return [p for p in picks if p.reserved_at + SHOWN_AFTER > heartbeat_at]


def discount(offer: Offer, picks: Iterable[Pick], app: str) -> Offer:
    """`offer` less `picks`: their guests off `free` (down to 0: the fit filters then say why), their machines
    on the counts."""
    cpus = memory = machines = of_app = 0
    for pick in picks:
        cpus += pick.cpus
        memory += pick.memory_mb
        machines += 1
        of_app += pick.app == app
    if machines == 0:
        return offer
    return msgspec.structs.replace(
        offer,
        free=Resources(cpus=max(0, offer.free.cpus - cpus), memory_mb=max(0, offer.free.memory_mb - memory)),
        machines=offer.machines + machines,
        app_machines=offer.app_machines + of_app,
    )


def offer_from_heartbeat(info: WorkerInfo, app: str, image: str | None) -> OfferReply:
    """What the worker would answer, from its last heartbeat: the `replica` strategy asks nobody.

    A heartbeat says less than an offer (not the launches in flight), so only a cordon declines here;
    the filters judge the numbers as they judge any offer's.
    """
    free = Resources(cpus=info.capacity.cpus - info.used.cpus, memory_mb=info.capacity.memory_mb - info.used.memory_mb)
    if info.cordoned:
        return Decline(worker_id=info.worker_id, region=info.region, reason="cordoned", free=free)
    return Offer(
        worker_id=info.worker_id,
        region=info.region,
        capacity=info.capacity,
        free=free,
        image_cached=image is not None and image in info.images,
        machines=info.machines,
        load=info.load,
        app_machines=info.app_machines.get(app, 0),
        sandboxes=info.sandboxes,
    )
