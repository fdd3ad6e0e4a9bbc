"""What a deploy would do, before it does anything: every step of its plan, and whether the fleet can take it.

`simulate` runs the planner against an imagined fleet in which every action succeeds and every machine
is healthy at once, step after step until nothing is left to do: the whole deploy (rolling batches,
spares after their primaries, blue destroyed after green), not just its first pass. `deploy --dry-run`
prints it. `problems` checks it against the live workers (their heartbeats, as
`fauxmad.v1.api.workers.list` answers): a region with no live worker, or without room for the machines
the deploy must create there, is a problem, and `deploy` refuses before it creates a release or a machine.

Room is counted, not auctioned: a dry-run auction (`placements.simulate`) places one machine and does not
see its own previous picks, so asking it N times says nothing about N machines. The workers' own rule
(a reserve fits if used + guest <= capacity, cpus and memory) applied to each live, uncordoned worker's
heartbeat answers for all N at once. Spares are not counted: a spare with no room is a warning the
reconciler retries, never a failed deploy.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet

import msgspec

from bus.contract.fleet import WorkerInfo
from bus.contract.machines import Guest
from orchestrator.apps.ownership import RUNNING
from orchestrator.apps.spec import PRIMARY, RELEASE_KEY, ROLE_KEY, AppSpec
from orchestrator.reconcile.actions import (
    Action,
    Create,
    Desired,
    Destroy,
    MachineAction,
    Member,
    Observed,
    Plan,
    Promote,
    Start,
    Stop,
    Update,
)
from orchestrator.reconcile.plan import plan

MAX_STEPS = 200
NEW = "new-"  # simulated machines: `new-1`, `new-2`, … (a real machine id is 14 hex digits)


class Planned(msgspec.Struct, kw_only=True):
    """One action of a simulated deploy, as `deploy --dry-run` shows it. Labels a machine does not have are
    None (null in JSON), as is the id and worker of a machine the deploy has yet to create."""

    step: int
    action: str
    region: str
    machine_id: str | None
    new: str | None  # `new-1`, `new-2`, …: a machine the deploy creates (how later steps and reasons name it)
    worker_id: str | None
    role: str | None  # after the action
    release: int | None  # after the action
    from_role: str | None
    from_release: int | None
    starts: bool  # a process (re)starts: a create that launches, a start, an update that restarts, a promote
    reason: str


def simulate(desired: Desired, observed: Observed, now: float, max_steps: int = MAX_STEPS) -> tuple[Plan, ...]:
    """The plans a deploy goes through if everything it does works at once; after the last, nothing is left."""
    return tuple(step for step, _ in _walk(desired, observed, now, max_steps))


def planned(desired: Desired, observed: Observed, now: float, max_steps: int = MAX_STEPS) -> list[Planned]:
    """Every action of the simulated deploy, step by step, with each machine's labels before and after."""
    out = []
    made = 0
    for number, (step, world) in enumerate(_walk(desired, observed, now, max_steps), 1):
        for action in step.actions:
            target = world.get(action.id) if isinstance(action, MachineAction) else None
            real = target if target is not None and not target.id.startswith(NEW) else None
            if isinstance(action, Create):
                made += 1
                new: str | None = f"{NEW}{made}"
            else:
                new = target.id if target is not None and real is None else None
            after = action.config if isinstance(action, Create | Update | Promote) else None
            labels = after.metadata if after is not None else target.config.metadata if target else {}
            was = real.config.metadata if real is not None else {}
            out.append(
                Planned(
                    step=number,
                    action=type(action).__name__.lower(),
                    region=action.region,
                    machine_id=real.id if real else None,
                    new=new,
                    worker_id=real.worker_id if real else None,
                    role=labels.get(ROLE_KEY),
                    release=_number(labels.get(RELEASE_KEY)),
                    from_role=was.get(ROLE_KEY),
                    from_release=_number(was.get(RELEASE_KEY)),
                    starts=_starts(action),
                    reason=action.reason,
                )
            )
    return out


def _number(label: str | None) -> int | None:
    return int(label) if label and label.isdigit() else None


def _starts(action: Action) -> bool:
    if isinstance(action, Create):
        return action.start
    if isinstance(action, Update):
        return action.restarts
    if isinstance(action, Promote):
        return action.start
    return isinstance(action, Start)


def _walk(desired: Desired, observed: Observed, now: float, max_steps: int) -> Iterator[tuple[Plan, dict[str, Member]]]:
    """Plan, imagine the plan done, plan again. New machines are `new-1`, `new-2`, … each on a worker of its
    own (so spares find a place); nothing crashes and every check passes at once."""
    world = {m.id: m for m in observed.machines}
    made = 0
    for _ in range(max_steps):
        imagined = msgspec.structs.replace(
            observed, machines=tuple(world.values()), unhealthy_since={}, exits_since=None
        )
        step = plan(desired, imagined, now)
        if not step.actions:
            return
        yield step, dict(world)
        for action in step.actions:
            if isinstance(action, Create):
                made += 1
                name = f"{NEW}{made}"
                world[name] = Member(
                    id=name,
                    region=action.region,
                    worker_id=name,
                    state="started" if action.start else "created",
                    config=action.config,
                    healthy=True,
                    created_at=f"~{made:09d}",  # after every real creation time
                )
            else:
                world = _apply(world, action)


def _apply(world: dict[str, Member], action: MachineAction) -> dict[str, Member]:
    m = world.get(action.id)
    if m is None:
        return world
    out = dict(world)
    if isinstance(action, Destroy):
        del out[action.id]
    elif isinstance(action, Start):
        out[m.id] = msgspec.structs.replace(m, state="started", healthy=True)
    elif isinstance(action, Stop):
        out[m.id] = msgspec.structs.replace(m, state="stopped", healthy=False)
    elif isinstance(action, Promote):
        state = "started" if action.start else m.state
        out[m.id] = msgspec.structs.replace(m, config=action.config, state=state, healthy=action.start)
    elif isinstance(action, Update):
        state = "started" if m.state in RUNNING else m.state
        out[m.id] = msgspec.structs.replace(m, config=action.config, state=state, healthy=True)
    return out


def primary_creates(steps: Iterable[Plan]) -> dict[str, int]:
    """How many primaries each region must place (new room the deploy needs there)."""
    needed: dict[str, int] = defaultdict(int)
    for step in steps:
        for action in step.actions:
            if isinstance(action, Create) and action.role == PRIMARY:
                needed[action.region] += 1
    return dict(needed)


def fits(worker: WorkerInfo, guest: Guest) -> int:
    """How many machines of `guest` the worker takes by its own reserve rule (used + guest <= capacity)."""
    if worker.cordoned:
        return 0
    cpus = (worker.capacity.cpus - worker.used.cpus) // guest.cpus
    memory = (worker.capacity.memory_mb - worker.used.memory_mb) // guest.memory_mb
    return max(0, min(cpus, memory))


def problems(
    spec: AppSpec, steps: Iterable[Plan], workers: Iterable[WorkerInfo], unread: AbstractSet[str] = frozenset()
) -> list[str]:
    """Why this deploy cannot work on the fleet as it is now, one line per region; empty if it can. `unread`: the
    regions whose workers could not be read (they did not answer), which are not said to have none."""
    by_region: dict[str, list[WorkerInfo]] = defaultdict(list)
    for w in workers:
        by_region[w.region].append(w)
    needed = primary_creates(steps)
    out = []
    for region, count in sorted(spec.regions.items()):
        if count == 0:
            continue
        live = by_region.get(region, [])
        if not live and region in unread:
            out.append(f"{region}: its workers could not be read: region {region} did not answer (try again shortly)")
            continue
        if not live:
            known = ", ".join(sorted(by_region)) or "none"
            out.append(f"{region}: no live workers in {region} (regions with live workers: {known})")
            continue
        if all(w.cordoned for w in live):
            out.append(f"{region}: every worker of {region} is cordoned ({len(live)})")
            continue
        want = needed.get(region, 0)
        room = sum(fits(w, spec.guest) for w in live)
        if want > room:
            out.append(
                f"{region}: room for {room} of the {want} new machines "
                f"({spec.guest.cpus} cpus, {spec.guest.memory_mb} MB each) on {len(live)} live workers"
            )
    return out
