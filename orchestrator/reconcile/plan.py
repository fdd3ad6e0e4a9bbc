"""The reconciler's brain: `plan(desired, observed, now) -> Plan`, a pure function with no I/O.

It compares one app's desired release with what the workers report and says what to do next:
create, start, stop, update, promote or destroy machines. It is level-triggered: it looks only at
the current state (never at what it did before), so a converged app yields an empty plan and a
plan interrupted halfway is simply planned again. Waiting (for health checks, for the unavailable
budget) is part of the answer, and so are failures (a release that never got healthy).

Roles live in machine metadata: `fauxmad_role` is `primary` (should run) or `spare` (created, not
started, on another worker than its primary, `standbys = [primary id]`); `fauxmad_replaces` marks a
machine that took over from another one (a lost host, a drained worker).

A lost or replaced primary's takeover is `failover`'s, spares are `spares`'s, and what both work with is
`actions`.

With an `[http_service]` that lets the edge proxy stop or create machines, a region's desired state is a
range (`ownership.region_range`): the planner creates up to the count, destroys only past what the edge
may add, and, when the edge decides which machines run, starts resting ones only below the floor.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

import msgspec

from bus.contract.fleet import CreateRequest
from bus.contract.machines import ExitInfo, MachineConfig
from orchestrator.apps.ownership import RUNNING
from orchestrator.apps.spec import PRIMARY, RELEASE_KEY, REPLACES_KEY, SPARE
from orchestrator.reconcile.actions import (
    GONE,
    RESTING,
    Create,
    Desired,
    Destroy,
    Failure,
    MachineAction,
    Member,
    Observed,
    Plan,
    Region,
    RegionStatus,
    Start,
    Update,
    created_order,
    keep_origin,
    strip_labels,
)
from orchestrator.reconcile.failover import end_takeovers, failover, retire_replaced, successors
from orchestrator.reconcile.spares import tend_spares


def plan_region(r: Region) -> RegionStatus:
    """One region's steps, in order: failover, retiring what was replaced, the count, the deploy, the takeovers'
    end, the spares. Their actions, waits and failures are added to `r`."""
    live_primaries = [m for m in r.members if m.role != SPARE]
    replaced_by = successors(live_primaries)
    r.replaced = {key for key in replaced_by if key}
    taking_over = failover(r, replaced_by)
    kept = retire_replaced(r, live_primaries, replaced_by)
    kept = count_primaries(r, kept, taking_over)
    run_primaries(r, kept)
    end_takeovers(r, kept)
    spares = tend_spares(r, kept)
    ready = sum(1 for m in kept if r.current(m) and r.ready(m))
    return RegionStatus(
        region=r.region,
        desired=r.count,
        ready=ready,
        primaries=len(kept),
        spares=spares,
        spares_wanted=len(kept) * (r.spec.deploy.spares if r.spec else 0),
    )


def count_primaries(r: Region, kept: list[Member], taking_over: int) -> list[Member]:
    """Create what is missing, destroy what is too many (on cordoned workers, outdated, unready first)."""
    bluegreen = r.spec is not None and r.spec.deploy.strategy == "bluegreen"
    counted = [m for m in kept if r.same_config(m)] if bluegreen else kept
    have = len(counted) + taking_over
    if have < r.count:
        hosts = sorted({m.worker_id for m in kept})
        for _ in range(r.count - have):
            r.add(
                Create(
                    request=CreateRequest(region=r.region, config=r.config_for(PRIMARY), prefer_away=hosts),
                    reason=f"{r.region} has {have} of {r.count} machines",
                )
            )
    elif r.range.too_many(have):  # past the count, the edge's auto_create may have added some
        newest_first = sorted(counted, key=created_order, reverse=True)
        disposable = sorted(
            newest_first, key=lambda m: (m.worker_id not in r.observed.cordoned, r.current(m), r.ready(m))
        )
        extras = disposable[: r.range.too_many(have)]
        most = f" (the edge may add up to {r.range.most})" if r.range.most > r.count else ""
        for m in extras:
            r.add(
                Destroy(
                    id=m.id,
                    region=r.region,
                    worker_id=m.worker_id,
                    reason=f"{r.region} wants {r.count}{most}, has {have}",
                )
            )
        gone = {m.id for m in extras}
        kept = [m for m in kept if m.id not in gone]
    return kept


def run_primaries(r: Region, kept: list[Member]) -> None:
    """Start resting primaries, relabel, and update outdated ones as the strategy's budget allows."""
    if r.spec is None:
        return
    outdated, in_flight = sort_primaries(r, kept)
    r.rolling = bool(outdated) or in_flight > 0
    if in_flight:
        r.waiting.append(f"{r.region}: {in_flight} machine(s) of v{r.release} not healthy yet")
    deploy = r.spec.deploy
    if deploy.strategy == "bluegreen":
        return  # blue machines go when every region's green ones are healthy (see `plan`)
    if deploy.strategy == "immediate":
        budget = len(outdated)
    else:
        budget = (1 if r.canary_phase else deploy.unavailable_budget(max(r.count, 1))) - in_flight
    budget = max(budget, 0)
    outdated.sort(key=lambda m: (r.ready(m), m.id))  # the broken ones first: they are down anyway
    for m in outdated[:budget]:
        r.add(
            Update(
                id=m.id,
                region=r.region,
                worker_id=m.worker_id,
                restarts=m.state in RUNNING,
                config=keep_origin(m, r.config_for(PRIMARY, replaces=r.claim(m))),
                reason=f"deploy v{r.release}",
            )
        )
    if len(outdated) > budget:
        r.waiting.append(f"{r.region}: {len(outdated) - budget} machine(s) wait their turn")


def sort_primaries(r: Region, kept: list[Member]) -> tuple[list[Member], int]:
    """The outdated primaries, and how many current ones are not ready yet (the deploy's in-flight)."""
    outdated: list[Member] = []
    in_flight = 0
    resting = [m for m in kept if m.id not in r.touched and r.current(m) and m.state in RESTING]
    resting = [m for m in resting if crashed(r, m) is None]
    starts = {m.id for m in sorted(resting, key=lambda m: m.id)[: r.range.to_start(r.running, len(resting))]}
    for m in kept:
        if m.id in r.touched:
            continue
        if not r.same_config(m):
            outdated.append(m)
            continue
        if not r.current(m):  # labels only: no restart, no budget
            r.relabel(m, labels_for_release(r, m), f"label release v{r.release}")
            continue
        crash = crashed(r, m)
        if crash is not None:
            r.failures.append(crash)
        elif m.id in starts:
            why = f"a primary is {m.state}"
            if r.range.edge_runs:
                why += f" and {r.region} runs {r.running} of the {r.range.keep_running} kept running"
            r.add(Start(id=m.id, region=r.region, worker_id=m.worker_id, reason=why))
        elif crash is None and r.edge_rests(m):
            continue  # resting by the edge's choice: not waited for
        if not r.ready(m):
            in_flight += 1
            r.unready.append(m.id)
            if crash is None:
                check_deadline(r, m)
    return outdated, in_flight


def crashed(r: Region, m: Member) -> Failure | None:
    """A primary of the release whose current instance ended on its own during the deploy: it exited,
    or it crash-loops under its restart policy. Waiting out `wait_timeout` would not help."""
    since, ended = r.observed.exits_since, m.exit
    if since is None or ended is None or ended.requested_stop or ended.lost:
        return None
    if ended.at < max(since, m.instance_at):
        return None  # before the deploy, or a previous instance's
    return Failure(region=r.region, machine_id=m.id, reason=describe_exit(ended), detail=stderr_tail(ended))


def labels_for_release(r: Region, m: Member) -> MachineConfig:
    metadata = dict(m.config.metadata)
    metadata[RELEASE_KEY] = r.release
    if r.claim(m) is None:
        metadata.pop(REPLACES_KEY, None)
    return msgspec.structs.replace(m.config, metadata=metadata)


def check_deadline(r: Region, m: Member) -> None:
    assert r.spec is not None
    if r.spec.deploy.strategy == "immediate":
        return
    since = r.observed.unhealthy_since.get(m.id, r.now)
    limit = r.spec.deploy.wait_seconds
    if r.now - since > limit:
        r.failures.append(
            Failure(
                region=r.region,
                machine_id=m.id,
                reason=f"not healthy within {limit:g}s",
                detail=m.note or f"state {m.state}",
            )
        )


def plan(desired: Desired, observed: Observed, now: float) -> Plan:
    """What to do next to bring `observed` to `desired`; the same inputs always give the same plan."""
    members: dict[str, list[Member]] = defaultdict(list)
    for m in observed.machines:
        members[m.region].append(m)
    lost: dict[str, list[Member]] = defaultdict(list)
    for m in observed.lost:
        lost[m.region].append(m)
    spec = desired.spec
    regions = sorted(set(members) | set(spec.regions if spec else ()))
    canary_phase = (
        spec is not None and spec.deploy.strategy == "canary" and not _every_region_has_a_canary(desired, members)
    )
    planners = [Region(desired, observed, now, r, members[r], lost[r], canary_phase) for r in regions]
    statuses = [plan_region(p) for p in planners]
    actions = [a for p in planners for a in p.actions]
    primary_actions = sum(p.primary_actions for p in planners)
    waiting = [w for p in planners for w in p.waiting]
    failures = [f for p in planners for f in p.failures]
    if spec is not None and spec.deploy.strategy == "bluegreen":
        blue = [m for p in planners for m in p.members if m.role != SPARE and not p.same_config(m)]
        if blue and all(s.ready >= s.desired for s in statuses):
            touched = {a.id for a in actions if isinstance(a, MachineAction)}
            for m in blue:
                if m.id not in touched:
                    actions.append(
                        Destroy(
                            id=m.id,
                            region=m.region,
                            worker_id=m.worker_id,
                            reason=f"v{desired.release} is healthy everywhere: blue goes",
                        )
                    )
                    primary_actions += 1
        elif blue:
            waiting.append(f"{len(blue)} blue machine(s) run until v{desired.release} is healthy in every region")
    return Plan(
        actions=tuple(actions),
        waiting=tuple(waiting),
        failures=tuple(failures),
        regions=tuple(statuses),
        primary_actions=primary_actions,
        unready=tuple(i for p in planners for i in p.unready),
    )


def summarize(failures: Iterable[Failure]) -> list[str]:
    """One line per distinct failure: machines that failed for the same reason, with details that differ
    only in numbers (ports, pids, seconds), are one line (`mad, syd: 4 machines exited with code 3: …`)."""
    groups: dict[tuple[str, str], list[Failure]] = {}
    for f in failures:
        groups.setdefault((f.reason, re.sub(r"\d+", "#", f.detail)), []).append(f)
    lines = []
    for (reason, _), group in groups.items():
        regions = ", ".join(sorted({f.region for f in group if f.region != "*"}))
        ids = list(dict.fromkeys(f.machine_id for f in group if f.machine_id))
        who = ids[0] if len(ids) == 1 else f"{len(ids)} machines" if ids else ""
        text = f"{who} {reason}" if who else reason
        if not ids and len(group) > 1:
            text += f" ({len(group)} times)"
        if group[0].detail:
            text += f": {group[0].detail}"
        lines.append(f"{regions}: {text}" if regions else text)
    return lines


def describe_exit(ended: ExitInfo) -> str:
    if ended.oom_killed:
        return "was killed: out of memory"
    if ended.signal is not None:
        return f"was killed by signal {ended.signal}"
    return f"exited with code {ended.exit_code}"


STDERR_LINES = 3
STDERR_CHARS = 300


def stderr_tail(ended: ExitInfo) -> str:
    """The last few lines a process wrote to stderr, as one line (`a | b | c`); empty if the worker sent none.
    A line repeated (the log holds every run of a crash-looping process) is shown once, where it last was."""
    lines: list[str] = []
    for line in reversed(ended.stderr_tail):
        line = line.strip()
        if line and line not in lines:
            lines.insert(0, line)
        if len(lines) == STDERR_LINES:
            break
    text = " | ".join(lines)
    return text if len(text) <= STDERR_CHARS else "…" + text[-STDERR_CHARS:]


def _every_region_has_a_canary(desired: Desired, members: Mapping[str, list[Member]]) -> bool:
    assert desired.spec is not None
    want = strip_labels(desired.spec.machine_config(desired.release, PRIMARY))
    for region, count in desired.spec.regions.items():
        if count == 0:
            continue
        primaries = [m for m in members.get(region, []) if m.role != SPARE and m.state not in GONE]
        outdated = [m for m in primaries if strip_labels(m.config) != want]
        canaries = [m for m in primaries if strip_labels(m.config) == want and m.state == "started" and m.healthy]
        if outdated and not canaries:
            return False
    return True
