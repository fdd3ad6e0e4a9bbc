"""A primary lost with its worker, or replaced (a drain, a host that came back): its takeover, step by step.

A takeover's claim (`fauxmad_replaces`) lasts while its predecessor may still run: lost, or back and not yet
retired (`retire_replaced` stops it, then keeps it as the successor's spare or destroys it). Once the
predecessor is a spare the takeover is over and the successor's claim is cleared (`end_takeovers`), so an instance
that fails back (its spare, the old primary, takes over again) never has two machines naming each other.
A claim cannot be cleared on a machine whose host is lost, so a pair may still come back naming each other
(A replaces B, and B, on the host that was lost before its claim was cleared, replaces A): `successors` breaks
any cycle at its newest claimant, the machine whose instance began last (promoting a resting spare starts a new
instance, so it is the one whose claim was made last; by id when they began together). That machine keeps
running, the claim naming it is ignored, and the other is retired as usual: exactly one copy runs. Before this
rule both stopped, each "replaced by" the other, and the region had no primary until a new machine started.
"""

from __future__ import annotations

from collections.abc import Iterable

from bus.contract.fleet import CreateRequest
from orchestrator.apps.ownership import RUNNING
from orchestrator.apps.spec import PRIMARY, SPARE
from orchestrator.reconcile.actions import GONE, Create, Destroy, Member, Promote, Region, Stop


def successors(primaries: Iterable[Member]) -> dict[str, Member]:
    """Who took over from whom among live primaries (predecessor id -> successor), with no cycle: in one, the
    newest claimant (latest instance, then highest id) stays, and the claim naming it is dropped (see the module
    docstring)."""
    replaced_by = {m.replaces: m for m in primaries if m.replaces}
    for start in list(replaced_by.values()):
        path: list[Member] = []  # start, its successor, that one's successor, ...
        at: Member | None = start
        while at is not None and at not in path:
            path.append(at)
            at = replaced_by.get(at.id)
        if at is not None:  # back at a machine on the path: from there on it is a cycle
            newest = max(path[path.index(at) :], key=lambda m: (m.instance_at, m.id))
            del replaced_by[newest.id]
    return replaced_by


def failover(r: Region, replaced_by: dict[str, Member]) -> int:
    """A primary on a lost worker: start one of its spares, or create a replacement."""
    if r.spec is None or r.count == 0:
        return 0
    spares = [m for m in r.members if m.role == SPARE]
    before = len(r.actions)
    for lost in sorted(r.lost, key=lambda m: m.id):
        if lost.role == SPARE or lost.id in replaced_by or lost.state in GONE:
            continue
        candidates = sorted(
            (s for s in spares if s.standby_of == lost.id and s.id not in r.touched),
            key=lambda s: (s.state not in RUNNING, s.worker_id in r.observed.cordoned, s.id),
        )
        # the replacement runs if the lost one did, or always when the operator decides what runs
        start = lost.state in RUNNING or not r.range.edge_runs
        if candidates:
            spare = candidates[0]
            config = r.labels(spare, PRIMARY, None, lost.id)
            r.add(
                Promote(
                    id=spare.id,
                    region=r.region,
                    worker_id=spare.worker_id,
                    config=config,
                    start=start,
                    reason=f"worker {lost.worker_id} of primary {lost.id} is lost",
                )
            )
        else:
            r.add(
                Create(
                    request=CreateRequest(
                        region=r.region, config=r.config_for(PRIMARY, replaces=lost.id), skip_launch=not start
                    ),
                    reason=f"worker {lost.worker_id} of primary {lost.id} is lost and it has no spare",
                    made_by="failover",
                )
            )
    return len(r.actions) - before


def retire_replaced(r: Region, live_primaries: list[Member], replaced_by: dict[str, Member]) -> list[Member]:
    """Machines another one took over from (their host came back, or they are being drained) go away
    once the successor is healthy: stopped, then kept as its spare or destroyed."""
    kept = []
    for m in live_primaries:
        successor = replaced_by.get(m.id)
        if successor is None:
            kept.append(m)
        elif m.state in RUNNING and not r.ready(successor) and not r.edge_rests(successor):
            r.waiting.append(f"{r.region}: {successor.id} to be healthy before {m.id} stops")
        elif m.state in RUNNING:
            r.add(Stop(id=m.id, region=r.region, worker_id=m.worker_id, reason=f"replaced by {successor.id}"))
        elif m.worker_id in r.observed.cordoned or r.spec is None or r.spec.deploy.spares == 0:
            r.add(Destroy(id=m.id, region=r.region, worker_id=m.worker_id, reason=f"replaced by {successor.id}"))
        else:  # its host came back: it can serve as the spare of the machine that replaced it
            r.relabel(
                m, r.labels(m, SPARE, successor.id, None), f"replaced by {successor.id}: kept as its spare", spare=True
            )
    if r.spec is not None and r.count > 0:  # drain: a replacement elsewhere first, then the old one stops
        for m in kept:
            if m.worker_id in r.observed.cordoned:
                r.add(
                    Create(
                        request=CreateRequest(
                            region=r.region, config=r.config_for(PRIMARY, replaces=m.id), avoid_workers=[m.worker_id]
                        ),
                        reason=f"worker {m.worker_id} is cordoned: moving {m.id}",
                        made_by="drain",
                    )
                )
    return kept


def end_takeovers(r: Region, kept: list[Member]) -> None:
    """Clear the claim of a primary whose predecessor is a spare now (a relabel: no restart); after the
    deploy's own updates, which clear it on the machines they touch."""
    for m in kept:
        if m.replaces and r.claim(m) is None and m.id not in r.touched:
            r.relabel(m, r.labels(m, PRIMARY, None, None), f"{m.replaces} is its spare now: the takeover is over")
