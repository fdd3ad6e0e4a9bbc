"""Spares: each primary gets `deploy.spares` stopped copies on other workers, kept on the release, reused when
orphaned, destroyed when too many; a spare the edge started for traffic is its to stop.
"""

from __future__ import annotations

from collections import defaultdict

from bus.contract.fleet import CreateRequest
from orchestrator.apps.ownership import RUNNING
from orchestrator.apps.spec import REPLACES_KEY, SPARE
from orchestrator.reconcile.actions import Create, Destroy, Member, Region, Stop, created_order, keep_origin


def tend_spares(r: Region, kept: list[Member]) -> int:
    """Each primary gets `deploy.spares` stopped copies on other workers; returns how many are in place."""
    wanted = r.spec.deploy.spares if r.spec else 0
    bluegreen = r.spec is not None and r.spec.deploy.strategy == "bluegreen"
    primaries = {
        m.id: m for m in kept if m.worker_id not in r.observed.cordoned and (not bluegreen or r.same_config(m))
    }
    mine, orphans = sort_spares(r, primaries)
    total = 0
    for p in sorted(primaries.values(), key=lambda m: m.id):
        have = sorted(mine.get(p.id, []), key=lambda s: (not current_spare(r, s, p), created_order(s)))
        for extra in have[wanted:]:
            r.add(
                Destroy(id=extra.id, region=r.region, worker_id=extra.worker_id, reason="too many spares"),
                spare=True,
            )
        have = have[:wanted]
        for s in have if not r.rolling else ():
            if not current_spare(r, s, p):
                make_spare(r, s, p, f"spare for v{r.release}")
        total += len(have) + fill_spares(r, p, wanted - len(have), {p.worker_id} | {s.worker_id for s in have}, orphans)
    for orphan in orphans:
        r.add(
            Destroy(id=orphan.id, region=r.region, worker_id=orphan.worker_id, reason="spare of nothing"),
            spare=True,
        )
    return total


def sort_spares(r: Region, primaries: dict[str, Member]) -> tuple[dict[str, list[Member]], list[Member]]:
    """Spares by the primary they stand by for, and the orphans (whose primary is gone or too close)."""
    waiting_for_failover = {m.id for m in r.lost} - r.replaced
    mine: dict[str, list[Member]] = defaultdict(list)
    orphans: list[Member] = []
    for s in r.members:
        if s.role != SPARE or s.id in r.touched or s.standby_of in waiting_for_failover:
            continue  # spares of a lost primary wait for its failover
        owner = primaries.get(s.standby_of or "")
        if s.state in RUNNING and r.range.edge_runs:
            if owner is not None and s.worker_id != owner.worker_id:
                mine[owner.id].append(s)  # the edge started it for traffic, and stops it when idle
            continue
        if s.state in RUNNING:
            r.add(
                Stop(
                    id=s.id,
                    region=r.region,
                    worker_id=s.worker_id,
                    reason="a spare runs while its primary is up",
                ),
                spare=True,
            )
        if s.state in RUNNING and (owner is None or owner.worker_id == s.worker_id):
            continue  # stopped now; found a place next time
        elif owner is None or s.worker_id == owner.worker_id or s.worker_id in r.observed.cordoned:
            orphans.append(s)
        else:
            mine[owner.id].append(s)
    return mine, orphans


def make_spare(r: Region, machine: Member, p: Member, reason: str) -> None:
    """Relabel `machine` in place (no restart) as a spare of `p` for this release."""
    r.relabel(machine, keep_origin(machine, r.config_for(SPARE, standby_of=p.id)), reason, spare=True)


def fill_spares(r: Region, p: Member, missing: int, taken: set[str], orphans: list[Member]) -> int:
    """Give `p` its missing spares: reuse orphans on other workers first, then create new ones."""
    filled = 0
    for orphan in list(orphans):
        if filled >= missing:
            break
        if orphan.worker_id not in taken and orphan.worker_id not in r.observed.cordoned:
            orphans.remove(orphan)
            make_spare(r, orphan, p, f"now the spare of {p.id}")
            taken.add(orphan.worker_id)
            filled += 1
    if r.region not in r.observed.no_room_for_spares:
        for _ in range(missing - filled):
            r.add(
                Create(
                    request=CreateRequest(
                        region=r.region,
                        config=r.config_for(SPARE, standby_of=p.id),
                        skip_launch=True,
                        avoid_workers=sorted(taken),
                    ),
                    reason=f"spare for {p.id}",
                    made_by="spare",
                ),
                spare=True,
            )
    return filled


def current_spare(r: Region, s: Member, p: Member) -> bool:
    return r.current(s) and s.standby_of == p.id and s.config.metadata.get(REPLACES_KEY) is None
