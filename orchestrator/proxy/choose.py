"""Which machine takes a request: one pure function over what the route table knows, after fly-proxy.

Regions are tried nearest first (the one a client asked for with `fauxmad-prefer-region`, then the
proxy's own, then the others by the configured latency table). The first pass looks for a started
machine under its soft limit, least loaded, ties broken at random (so many proxies do not all pick the
same machine). When there is none, a stopped machine is started (autostart) before anything is sent to
a machine over its soft limit: that is what the soft limit is for. Then a started machine under its
hard limit, least loaded, nearest first. Then a new machine (auto_create) if a region may have one more.
If machines exist but all are at their hard limit, the request waits (bounded, by the caller); with no
way at all, the answer says why, for the 502.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple

# States from which a start makes the machine serve. A machine still `stopping` (its autostop met a request halfway)
# is started once its stop ends: its worker's start waits for that.
STARTABLE = frozenset({"created", "stopped", "failed", "stopping"})
# A suspended (or suspending) machine is resumed (SIGCONT), cheaper than any start.
WAKEABLE = STARTABLE | {"suspended", "suspending"}
AT_REST = WAKEABLE - {"stopping"}  # woken before any machine still stopping (its start waits for the stop)


class Candidate(NamedTuple):
    id: str
    region: str
    state: str  # the routing index's; a machine this proxy is starting counts as started
    load: int  # requests (or connections) this proxy has in flight on it


class Policy(NamedTuple):
    soft_limit: int
    hard_limit: int
    auto_start: bool
    auto_create: bool
    max_per_region: int  # machines auto_create may make a region have (`ownership.RegionRange.most`) …
    most_in: Mapping[str, int] = {}  # … unless the region is listed here (a release's count may be larger)


class Route(NamedTuple):
    machine_id: str


class Start(NamedTuple):
    machine_id: str


class Create(NamedTuple):
    region: str


class Wait(NamedTuple):
    """Every usable machine is at its hard limit: wait for a slot."""


class NoMachine(NamedTuple):
    why: str


Decision = Route | Start | Create | Wait | NoMachine


def region_order(regions: Iterable[str], own: str, prefer: str | None, latency: Mapping[str, float]) -> list[str]:
    """The regions to try, nearest first: `prefer`, `own`, then by latency from `own` (unknown: last, by name)."""
    first = [r for r in (prefer, own) if r]
    rest = sorted(set(regions) - set(first), key=lambda r: (latency.get(r, float("inf")), r))
    return list(dict.fromkeys(first)) + rest


def _least_loaded(machines: Sequence[Candidate], rng: random.Random) -> Candidate:
    if len(machines) == 1:
        return machines[0]
    low = min(m.load for m in machines)
    tied = [m for m in machines if m.load == low]
    return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]


def choose(
    candidates: Sequence[Candidate],
    policy: Policy,
    order: Sequence[str],
    rng: random.Random,
    avoid: AbstractSet[str] = frozenset(),
) -> Decision:
    """`order` from `region_order` (it may name regions without machines: auto_create can fill them);
    `avoid`: machines that failed this request already, or refused connections lately."""
    by_region: dict[str, list[Candidate]] = {}
    started: dict[str, list[Candidate]] = {}
    for machine in candidates:
        if machine.id not in avoid:
            by_region.setdefault(machine.region, []).append(machine)
            if machine.state == "started":
                started.setdefault(machine.region, []).append(machine)
    regions = list(order)
    if not by_region.keys() <= set(regions):
        regions += sorted(set(by_region) - set(order))
    decision: Decision | None = _under(started, regions, policy.soft_limit, rng)
    if decision is None and policy.auto_start:
        decision = _startable(by_region, regions)
    if decision is None:
        decision = _under(started, regions, policy.hard_limit, rng)
    if decision is None and policy.auto_create:
        decision = _room(by_region, order, policy)
    if decision is not None:
        return decision
    if any(started.values()):
        return Wait()
    return NoMachine(_why(candidates, policy, avoid))


def _under(
    started: Mapping[str, list[Candidate]], regions: Sequence[str], limit: int, rng: random.Random
) -> Route | None:
    """The least loaded started machine under `limit` in the nearest region that has one."""
    for region in regions:
        machines = started.get(region)
        if not machines:
            continue
        under = [m for m in machines if m.load < limit]
        if under:
            return Route(_least_loaded(under, rng).id)
    return None


def _startable(by_region: Mapping[str, list[Candidate]], regions: Sequence[str]) -> Start | None:
    """The machine to wake, nearest region first: resumed before started (milliseconds, not a program). A machine
    still `stopping` only when no region has one at rest: its start waits for its stop to end."""
    for states in (AT_REST, {"stopping"}):
        for region in regions:
            stopped = sorted(
                (m for m in by_region.get(region, []) if m.state in states),
                key=lambda m: (m.state not in ("suspended", "suspending"), m.id),
            )
            if stopped:
                return Start(stopped[0].id)
    return None


def _room(by_region: Mapping[str, list[Candidate]], order: Sequence[str], policy: Policy) -> Create | None:
    for region in order:
        if len(by_region.get(region, [])) < policy.most_in.get(region, policy.max_per_region):
            return Create(region)
    return None


def _why(candidates: Sequence[Candidate], policy: Policy, avoid: AbstractSet[str]) -> str:
    if not candidates:
        return "it has no machines" + ("" if policy.auto_create else " (auto_create is off)")
    if all(m.id in avoid for m in candidates):
        return f"{len(candidates)} machine(s) refused the connection or failed"
    states = sorted({m.state for m in candidates if m.id not in avoid})
    tail = "" if policy.auto_start else " and auto_start is off"
    return f"none is started (states: {', '.join(states)}){tail}"
