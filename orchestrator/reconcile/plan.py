"""The reconciler's brain: `plan(desired, observed, now) -> Plan`, a pure function with no I/O.

It compares one app's desired release with what the workers report and says what to do next:
create, start, stop, update, promote or destroy machines. It is level-triggered: it looks only at
the current state (never at what it did before), so a converged app yields an empty plan and a
plan interrupted halfway is simply planned again. Waiting (for health checks, for the unavailable
budget) is part of the answer, and so are failures (a release that never got healthy).

Roles live in machine metadata: `fauxmad_role` is `primary` (should run) or `spare` (created, not
started, on another worker than its primary, `standbys = [primary id]`); `fauxmad_replaces` marks a
machine that took over from another one (a lost host, a drained worker).

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

With an `[http_service]` that lets the edge proxy stop or create machines, a region's desired state is a
range (`ownership.region_range`): the planner creates up to the count, destroys only past what the edge
may add, and, when the edge decides which machines run, starts resting ones only below the floor.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

import msgspec

from bus.contract.fleet import Preset
from bus.contract.machines import ExitInfo, MachineConfig
from orchestrator.reconcile.ownership import CREATED_BY_KEY, CREATED_FOR_KEY, RUNNING, region_range
from orchestrator.reconcile.spec import PRIMARY, RELEASE_KEY, REPLACES_KEY, ROLE_KEY, SPARE, AppSpec

RESTING = ("created", "stopped", "failed")
GONE = ("destroying", "destroyed")


class Member(msgspec.Struct, frozen=True, kw_only=True):
    """One machine as the planner sees it (built from a worker's answer or the routing index)."""

    id: str
    region: str
    worker_id: str
    state: str
    config: MachineConfig
    healthy: bool = False
    note: str = ""  # why it is not healthy (check output), for failure messages
    created_at: str = ""
    exit: ExitInfo | None = None  # how its process last ended
    instance_at: float = 0.0  # when its current instance (config) began, epoch seconds; 0: unknown

    @property
    def role(self) -> str:
        return self.config.metadata.get(ROLE_KEY, PRIMARY)

    @property
    def release(self) -> str:
        return self.config.metadata.get(RELEASE_KEY, "")

    @property
    def replaces(self) -> str | None:
        return self.config.metadata.get(REPLACES_KEY)

    @property
    def standby_of(self) -> str | None:
        return self.config.standbys[0] if self.config.standbys else None


class Observed(msgspec.Struct, frozen=True, kw_only=True):
    machines: tuple[Member, ...] = ()  # on live workers, not destroyed
    lost: tuple[Member, ...] = ()  # last known, on workers whose heartbeat expired
    cordoned: frozenset[str] = frozenset()
    unhealthy_since: Mapping[str, float] = {}  # machine id -> when first seen unhealthy on the desired release
    no_room_for_spares: frozenset[str] = frozenset()  # regions where a spare just failed to place
    # a deploy's start (epoch seconds): a primary of the release whose process ended on its own since then
    # fails its region at once. None (the operator): exits are left to the workers' restart policies.
    exits_since: float | None = None


class Desired(msgspec.Struct, frozen=True, kw_only=True):
    app: str
    release: int
    spec: AppSpec | None  # None: the app is being destroyed


# ---------------------------------------------------------------------------------------------------
# actions


class Create(msgspec.Struct, frozen=True, kw_only=True, tag="create"):
    region: str
    config: MachineConfig
    start: bool
    avoid_workers: tuple[str, ...] = ()  # never on these
    prefer_away: tuple[str, ...] = ()  # not on these while another worker has room (spreading primaries)
    placement_preset: Preset | None = None  # the spec's `[placement] preset`, for the brokers' chain
    reason: str = ""
    made_by: str = "deploy"  # why it exists, kept in its metadata (ownership.CREATED_BY_KEY): deploy, failover, …

    @property
    def role(self) -> str:
        return self.config.metadata.get(ROLE_KEY, PRIMARY)


class MachineAction(msgspec.Struct, frozen=True, kw_only=True):
    """An action on one existing machine, sent to the worker that owns it."""

    id: str
    region: str
    worker_id: str
    reason: str = ""


class Start(MachineAction, frozen=True, kw_only=True, tag="start"):
    pass


class Stop(MachineAction, frozen=True, kw_only=True, tag="stop"):
    pass


class Update(MachineAction, frozen=True, kw_only=True, tag="update"):
    config: MachineConfig
    restarts: bool  # False when only labels change or the machine is not running


class Promote(MachineAction, frozen=True, kw_only=True, tag="promote"):
    """Relabel a spare as the primary that replaces a lost one, then start it (unless the lost one rested
    and the edge decides what runs: then it takes over stopped, and the edge starts it for traffic)."""

    config: MachineConfig
    start: bool = True


class Destroy(MachineAction, frozen=True, kw_only=True, tag="destroy"):
    pass


Action = Create | Start | Stop | Update | Promote | Destroy


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    region: str  # "*": the whole deploy (a timeout, an interruption)
    machine_id: str
    reason: str  # what went wrong, the same words for every machine it happened to
    detail: str = ""  # this machine's evidence: the end of its stderr, its check's output


class RegionStatus(msgspec.Struct, frozen=True, kw_only=True):
    region: str
    desired: int
    ready: int  # primaries on the desired release, running and healthy
    primaries: int
    spares: int
    spares_wanted: int


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    actions: tuple[Action, ...] = ()
    waiting: tuple[str, ...] = ()
    failures: tuple[Failure, ...] = ()
    regions: tuple[RegionStatus, ...] = ()

    @property
    def converged(self) -> bool:
        """Nothing to do, nothing to wait for, nothing failed."""
        return not self.actions and not self.waiting and not self.failures

    primary_actions: int = 0  # actions that touch primaries (the rest tend spares)
    unready: tuple[str, ...] = ()  # primaries on the desired release not healthy yet (their clock runs)

    @property
    def primaries_done(self) -> bool:
        """Every primary is in place and healthy; spares may still be on their way (or find no room)."""
        return not self.waiting and not self.failures and self.primary_actions == 0


# ---------------------------------------------------------------------------------------------------


def strip_labels(config: MachineConfig) -> MachineConfig:
    return msgspec.structs.replace(config, metadata={}, standbys=[])


def keep_origin(m: Member, config: MachineConfig) -> MachineConfig:
    """`config` with `m`'s record of who made it and why, which a new release's labels would drop."""
    origin = {k: v for k, v in m.config.metadata.items() if k in (CREATED_BY_KEY, CREATED_FOR_KEY)}
    return msgspec.structs.replace(config, metadata={**config.metadata, **origin}) if origin else config


def _created_order(m: Member) -> tuple[str, str]:
    return (m.created_at, m.id)


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


class _RegionPlanner:
    def __init__(
        self,
        desired: Desired,
        observed: Observed,
        now: float,
        region: str,
        members: list[Member],
        lost: list[Member],
        canary_phase: bool,
    ) -> None:
        self.desired = desired
        self.spec = desired.spec
        self.observed = observed
        self.now = now
        self.region = region
        self.members = [m for m in members if m.state not in GONE]
        self.lost = lost
        self.canary_phase = canary_phase
        self.count = self.spec.regions.get(region, 0) if self.spec else 0
        self.range = region_range(self.count, self.spec.http_service if self.spec else None)
        self.running = sum(1 for m in self.members if m.state in RUNNING)  # any role: the edge counts them all
        self.release = str(desired.release)
        self.want = strip_labels(self.spec.machine_config(desired.release, PRIMARY)) if self.spec else None
        self.actions: list[Action] = []
        self.primary_actions = 0
        self.unready: list[str] = []
        self.rolling = False  # primaries still moving to the release: spares follow once they are done
        self.replaced: set[str] = set()
        self.spare_ids = {m.id for m in self.members if m.role == SPARE}
        self.waiting: list[str] = []
        self.failures: list[Failure] = []
        self.touched: set[str] = set()

    # -- helpers ---------------------------------------------------------------------------------
    def config_for(self, role: str, standby_of: str | None = None, replaces: str | None = None) -> MachineConfig:
        assert self.spec is not None
        return self.spec.machine_config(self.desired.release, role, standby_of, replaces)

    def same_config(self, m: Member) -> bool:
        return self.want is not None and strip_labels(m.config) == self.want

    def current(self, m: Member) -> bool:
        return self.same_config(m) and m.release == self.release

    def ready(self, m: Member) -> bool:
        if self.spec is not None and self.spec.deploy.strategy == "immediate":
            return m.state in RUNNING
        return m.state == "started" and m.healthy

    def add(self, action: Action, *, spare: bool = False) -> None:
        if isinstance(action, MachineAction):
            if action.id in self.touched:
                return
            self.touched.add(action.id)
        elif self.spec is not None and self.spec.placement.preset is not None:  # every create places per the spec
            action = msgspec.structs.replace(action, placement_preset=self.spec.placement.preset)
        self.actions.append(action)
        self.primary_actions += 0 if spare else 1

    def labels(self, m: Member, role: str, standby_of: str | None, replaces: str | None) -> MachineConfig:
        """`m`'s config with new labels, keeping everything the process sees."""
        metadata = dict(m.config.metadata)
        metadata[ROLE_KEY] = role
        metadata.pop(REPLACES_KEY, None)
        if replaces:
            metadata[REPLACES_KEY] = replaces
        return msgspec.structs.replace(m.config, metadata=metadata, standbys=[standby_of] if standby_of else [])

    def claim(self, m: Member) -> str | None:
        """The machine `m` took over from, while that takeover lasts: until the predecessor is a spare."""
        return None if m.replaces in self.spare_ids else m.replaces

    def edge_rests(self, m: Member) -> bool:
        """`m` is not running, and whether it runs is the edge's call (it starts it for the next request)."""
        return self.range.edge_runs and m.state not in RUNNING

    # -- the steps -------------------------------------------------------------------------------
    def plan(self) -> RegionStatus:
        live_primaries = [m for m in self.members if m.role != SPARE]
        replaced_by = successors(live_primaries)
        self.replaced = {key for key in replaced_by if key}
        taking_over = self.failover(replaced_by)
        kept = self.retire_replaced(live_primaries, replaced_by)
        kept = self.count_primaries(kept, taking_over)
        self.run_primaries(kept)
        self.end_takeovers(kept)
        spares = self.tend_spares(kept)
        ready = sum(1 for m in kept if self.current(m) and self.ready(m))
        return RegionStatus(
            region=self.region,
            desired=self.count,
            ready=ready,
            primaries=len(kept),
            spares=spares,
            spares_wanted=len(kept) * (self.spec.deploy.spares if self.spec else 0),
        )

    def failover(self, replaced_by: dict[str, Member]) -> int:
        """A primary on a lost worker: start one of its spares, or create a replacement."""
        if self.spec is None or self.count == 0:
            return 0
        spares = [m for m in self.members if m.role == SPARE]
        before = len(self.actions)
        for lost in sorted(self.lost, key=lambda m: m.id):
            if lost.role == SPARE or lost.id in replaced_by or lost.state in GONE:
                continue
            candidates = sorted(
                (s for s in spares if s.standby_of == lost.id and s.id not in self.touched),
                key=lambda s: (s.state not in RUNNING, s.worker_id in self.observed.cordoned, s.id),
            )
            # the replacement runs if the lost one did, or always when the operator decides what runs
            start = lost.state in RUNNING or not self.range.edge_runs
            if candidates:
                spare = candidates[0]
                config = self.labels(spare, PRIMARY, None, lost.id)
                self.add(
                    Promote(
                        id=spare.id,
                        region=self.region,
                        worker_id=spare.worker_id,
                        config=config,
                        start=start,
                        reason=f"worker {lost.worker_id} of primary {lost.id} is lost",
                    )
                )
            else:
                self.add(
                    Create(
                        region=self.region,
                        config=self.config_for(PRIMARY, replaces=lost.id),
                        start=start,
                        reason=f"worker {lost.worker_id} of primary {lost.id} is lost and it has no spare",
                        made_by="failover",
                    )
                )
        return len(self.actions) - before

    def retire_replaced(self, live_primaries: list[Member], replaced_by: dict[str, Member]) -> list[Member]:
        """Machines another one took over from (their host came back, or they are being drained) go away
        once the successor is healthy: stopped, then kept as its spare or destroyed."""
        kept = []
        for m in live_primaries:
            successor = replaced_by.get(m.id)
            if successor is None:
                kept.append(m)
            elif m.state in RUNNING and not self.ready(successor) and not self.edge_rests(successor):
                self.waiting.append(f"{self.region}: {successor.id} to be healthy before {m.id} stops")
            elif m.state in RUNNING:
                self.add(Stop(id=m.id, region=self.region, worker_id=m.worker_id, reason=f"replaced by {successor.id}"))
            elif m.worker_id in self.observed.cordoned or self.spec is None or self.spec.deploy.spares == 0:
                self.add(
                    Destroy(id=m.id, region=self.region, worker_id=m.worker_id, reason=f"replaced by {successor.id}")
                )
            else:  # its host came back: it can serve as the spare of the machine that replaced it
                self.add(
                    Update(
                        id=m.id,
                        region=self.region,
                        worker_id=m.worker_id,
                        restarts=False,
                        config=self.labels(m, SPARE, successor.id, None),
                        reason=f"replaced by {successor.id}: kept as its spare",
                    ),
                    spare=True,
                )
        if self.spec is not None and self.count > 0:  # drain: a replacement elsewhere first, then the old one stops
            for m in kept:
                if m.worker_id in self.observed.cordoned:
                    self.add(
                        Create(
                            region=self.region,
                            config=self.config_for(PRIMARY, replaces=m.id),
                            start=True,
                            avoid_workers=(m.worker_id,),
                            reason=f"worker {m.worker_id} is cordoned: moving {m.id}",
                            made_by="drain",
                        )
                    )
        return kept

    def count_primaries(self, kept: list[Member], taking_over: int) -> list[Member]:
        """Create what is missing, destroy what is too many (on cordoned workers, outdated, unready first)."""
        bluegreen = self.spec is not None and self.spec.deploy.strategy == "bluegreen"
        counted = [m for m in kept if self.same_config(m)] if bluegreen else kept
        have = len(counted) + taking_over
        if have < self.count:
            hosts = tuple(sorted({m.worker_id for m in kept}))
            for _ in range(self.count - have):
                self.add(
                    Create(
                        region=self.region,
                        config=self.config_for(PRIMARY),
                        start=True,
                        prefer_away=hosts,
                        reason=f"{self.region} has {have} of {self.count} machines",
                    )
                )
        elif self.range.too_many(have):  # past the count, the edge's auto_create may have added some
            newest_first = sorted(counted, key=_created_order, reverse=True)
            disposable = sorted(
                newest_first, key=lambda m: (m.worker_id not in self.observed.cordoned, self.current(m), self.ready(m))
            )
            extras = disposable[: self.range.too_many(have)]
            most = f" (the edge may add up to {self.range.most})" if self.range.most > self.count else ""
            for m in extras:
                self.add(
                    Destroy(
                        id=m.id,
                        region=self.region,
                        worker_id=m.worker_id,
                        reason=f"{self.region} wants {self.count}{most}, has {have}",
                    )
                )
            gone = {m.id for m in extras}
            kept = [m for m in kept if m.id not in gone]
        return kept

    def run_primaries(self, kept: list[Member]) -> None:
        """Start resting primaries, relabel, and update outdated ones as the strategy's budget allows."""
        if self.spec is None:
            return
        outdated, in_flight = self.sort_primaries(kept)
        self.rolling = bool(outdated) or in_flight > 0
        if in_flight:
            self.waiting.append(f"{self.region}: {in_flight} machine(s) of v{self.release} not healthy yet")
        deploy = self.spec.deploy
        if deploy.strategy == "bluegreen":
            return  # blue machines go when every region's green ones are healthy (see `plan`)
        if deploy.strategy == "immediate":
            budget = len(outdated)
        else:
            budget = (1 if self.canary_phase else deploy.unavailable_budget(max(self.count, 1))) - in_flight
        budget = max(budget, 0)
        outdated.sort(key=lambda m: (self.ready(m), m.id))  # the broken ones first: they are down anyway
        for m in outdated[:budget]:
            self.add(
                Update(
                    id=m.id,
                    region=self.region,
                    worker_id=m.worker_id,
                    restarts=m.state in RUNNING,
                    config=keep_origin(m, self.config_for(PRIMARY, replaces=self.claim(m))),
                    reason=f"deploy v{self.release}",
                )
            )
        if len(outdated) > budget:
            self.waiting.append(f"{self.region}: {len(outdated) - budget} machine(s) wait their turn")

    def sort_primaries(self, kept: list[Member]) -> tuple[list[Member], int]:
        """The outdated primaries, and how many current ones are not ready yet (the deploy's in-flight)."""
        outdated: list[Member] = []
        in_flight = 0
        resting = [m for m in kept if m.id not in self.touched and self.current(m) and m.state in RESTING]
        resting = [m for m in resting if self.crashed(m) is None]
        starts = {m.id for m in sorted(resting, key=lambda m: m.id)[: self.range.to_start(self.running, len(resting))]}
        for m in kept:
            if m.id in self.touched:
                continue
            if not self.same_config(m):
                outdated.append(m)
                continue
            if not self.current(m):  # labels only: no restart, no budget
                self.add(
                    Update(
                        id=m.id,
                        region=self.region,
                        worker_id=m.worker_id,
                        restarts=False,
                        config=self.labels_for_release(m),
                        reason=f"label release v{self.release}",
                    )
                )
                continue
            crash = self.crashed(m)
            if crash is not None:
                self.failures.append(crash)
            elif m.id in starts:
                why = f"a primary is {m.state}"
                if self.range.edge_runs:
                    why += f" and {self.region} runs {self.running} of the {self.range.keep_running} kept running"
                self.add(Start(id=m.id, region=self.region, worker_id=m.worker_id, reason=why))
            elif crash is None and self.edge_rests(m):
                continue  # resting by the edge's choice: not waited for
            if not self.ready(m):
                in_flight += 1
                self.unready.append(m.id)
                if crash is None:
                    self.check_deadline(m)
        return outdated, in_flight

    def crashed(self, m: Member) -> Failure | None:
        """A primary of the release whose current instance ended on its own during the deploy: it exited,
        or it crash-loops under its restart policy. Waiting out `wait_timeout` would not help."""
        since, ended = self.observed.exits_since, m.exit
        if since is None or ended is None or ended.requested_stop or ended.lost:
            return None
        if ended.at < max(since, m.instance_at):
            return None  # before the deploy, or a previous instance's
        return Failure(region=self.region, machine_id=m.id, reason=describe_exit(ended), detail=stderr_tail(ended))

    def labels_for_release(self, m: Member) -> MachineConfig:
        metadata = dict(m.config.metadata)
        metadata[RELEASE_KEY] = self.release
        if self.claim(m) is None:
            metadata.pop(REPLACES_KEY, None)
        return msgspec.structs.replace(m.config, metadata=metadata)

    def end_takeovers(self, kept: list[Member]) -> None:
        """Clear the claim of a primary whose predecessor is a spare now (a relabel: no restart); after the
        deploy's own updates, which clear it on the machines they touch."""
        for m in kept:
            if m.replaces and self.claim(m) is None and m.id not in self.touched:
                self.add(
                    Update(
                        id=m.id,
                        region=self.region,
                        worker_id=m.worker_id,
                        restarts=False,
                        config=self.labels(m, PRIMARY, None, None),
                        reason=f"{m.replaces} is its spare now: the takeover is over",
                    )
                )

    def check_deadline(self, m: Member) -> None:
        assert self.spec is not None
        if self.spec.deploy.strategy == "immediate":
            return
        since = self.observed.unhealthy_since.get(m.id, self.now)
        limit = self.spec.deploy.wait_seconds
        if self.now - since > limit:
            self.failures.append(
                Failure(
                    region=self.region,
                    machine_id=m.id,
                    reason=f"not healthy within {limit:g}s",
                    detail=m.note or f"state {m.state}",
                )
            )

    def tend_spares(self, kept: list[Member]) -> int:
        """Each primary gets `deploy.spares` stopped copies on other workers; returns how many are in place."""
        wanted = self.spec.deploy.spares if self.spec else 0
        bluegreen = self.spec is not None and self.spec.deploy.strategy == "bluegreen"
        primaries = {
            m.id: m
            for m in kept
            if m.worker_id not in self.observed.cordoned and (not bluegreen or self.same_config(m))
        }
        mine, orphans = self.sort_spares(primaries)
        total = 0
        for p in sorted(primaries.values(), key=lambda m: m.id):
            have = sorted(mine.get(p.id, []), key=lambda s: (not self.current_spare(s, p), _created_order(s)))
            for extra in have[wanted:]:
                self.add(
                    Destroy(id=extra.id, region=self.region, worker_id=extra.worker_id, reason="too many spares"),
                    spare=True,
                )
            have = have[:wanted]
            for s in have if not self.rolling else ():
                if not self.current_spare(s, p):
                    self.make_spare(s, p, f"spare for v{self.release}")
            total += len(have) + self.fill_spares(
                p, wanted - len(have), {p.worker_id} | {s.worker_id for s in have}, orphans
            )
        for orphan in orphans:
            self.add(
                Destroy(id=orphan.id, region=self.region, worker_id=orphan.worker_id, reason="spare of nothing"),
                spare=True,
            )
        return total

    def sort_spares(self, primaries: dict[str, Member]) -> tuple[dict[str, list[Member]], list[Member]]:
        """Spares by the primary they stand by for, and the orphans (whose primary is gone or too close)."""
        waiting_for_failover = {m.id for m in self.lost} - self.replaced
        mine: dict[str, list[Member]] = defaultdict(list)
        orphans: list[Member] = []
        for s in self.members:
            if s.role != SPARE or s.id in self.touched or s.standby_of in waiting_for_failover:
                continue  # spares of a lost primary wait for its failover
            owner = primaries.get(s.standby_of or "")
            if s.state in RUNNING and self.range.edge_runs:
                if owner is not None and s.worker_id != owner.worker_id:
                    mine[owner.id].append(s)  # the edge started it for traffic, and stops it when idle
                continue
            if s.state in RUNNING:
                self.add(
                    Stop(
                        id=s.id,
                        region=self.region,
                        worker_id=s.worker_id,
                        reason="a spare runs while its primary is up",
                    ),
                    spare=True,
                )
            if s.state in RUNNING and (owner is None or owner.worker_id == s.worker_id):
                continue  # stopped now; found a place next time
            elif owner is None or s.worker_id == owner.worker_id or s.worker_id in self.observed.cordoned:
                orphans.append(s)
            else:
                mine[owner.id].append(s)
        return mine, orphans

    def make_spare(self, machine: Member, p: Member, reason: str) -> None:
        """Relabel `machine` in place (no restart) as a spare of `p` for this release."""
        self.add(
            Update(
                id=machine.id,
                region=self.region,
                worker_id=machine.worker_id,
                restarts=False,
                config=keep_origin(machine, self.config_for(SPARE, standby_of=p.id)),
                reason=reason,
            ),
            spare=True,
        )

    def fill_spares(self, p: Member, missing: int, taken: set[str], orphans: list[Member]) -> int:
        """Give `p` its missing spares: reuse orphans on other workers first, then create new ones."""
        filled = 0
        for orphan in list(orphans):
            if filled >= missing:
                break
            if orphan.worker_id not in taken and orphan.worker_id not in self.observed.cordoned:
                orphans.remove(orphan)
                self.make_spare(orphan, p, f"now the spare of {p.id}")
                taken.add(orphan.worker_id)
                filled += 1
        if self.region not in self.observed.no_room_for_spares:
            for _ in range(missing - filled):
                self.add(
                    Create(
                        region=self.region,
                        config=self.config_for(SPARE, standby_of=p.id),
                        start=False,
                        avoid_workers=tuple(sorted(taken)),
                        reason=f"spare for {p.id}",
                        made_by="spare",
                    ),
                    spare=True,
                )
        return filled

    def current_spare(self, s: Member, p: Member) -> bool:
        return self.current(s) and s.standby_of == p.id and s.config.metadata.get(REPLACES_KEY) is None


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
    planners = [_RegionPlanner(desired, observed, now, r, members[r], lost[r], canary_phase) for r in regions]
    statuses = [p.plan() for p in planners]
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
