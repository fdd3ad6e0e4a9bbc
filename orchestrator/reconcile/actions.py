"""What the planner works with and answers with: the machines it sees (`Member`, `Observed`), what is wanted
(`Desired`), the actions it asks for (create, start, stop, update, promote, destroy), its verdict (`Plan`), and
`Region`, one region's view that the planning steps read and add their actions to.

The steps live by seam: the primaries and the deploy's budget in `plan`, a lost or replaced primary in
`failover`, the spares in `spares`. Each is a function of a `Region`, so a step can be read without the others.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from bus.contract.fleet import CreateRequest
from bus.contract.machines import ExitInfo, MachineConfig
from orchestrator.apps.ownership import CREATED_BY_KEY, CREATED_FOR_KEY, RUNNING, region_range
from orchestrator.apps.spec import PRIMARY, RELEASE_KEY, REPLACES_KEY, ROLE_KEY, SPARE, AppSpec

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
    """A new machine: the create the brokers take, whole (its region, config, whether it starts, and the
    placement rules: `avoid_workers` never, `prefer_away` only if no other has room, the spec's preset), and
    why it is made. The executor sends `request` as it is, with the why in its metadata."""

    request: CreateRequest
    reason: str = ""
    made_by: str = "deploy"  # why it exists, kept in its metadata (ownership.CREATED_BY_KEY): deploy, failover, …

    @property
    def region(self) -> str:
        return self.request.region

    @property
    def config(self) -> MachineConfig:
        return self.request.config

    @property
    def start(self) -> bool:
        return not self.request.skip_launch

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


def strip_labels(config: MachineConfig) -> MachineConfig:
    return msgspec.structs.replace(config, metadata={}, standbys=[])


def keep_origin(m: Member, config: MachineConfig) -> MachineConfig:
    """`config` with `m`'s record of who made it and why, which a new release's labels would drop."""
    origin = {k: v for k, v in m.config.metadata.items() if k in (CREATED_BY_KEY, CREATED_FOR_KEY)}
    return msgspec.structs.replace(config, metadata={**config.metadata, **origin}) if origin else config


def created_order(m: Member) -> tuple[str, str]:
    return (m.created_at, m.id)


class Region:
    """One region of one app as the planner sees it, and the actions, waits and failures its steps add."""

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
            placed = msgspec.structs.replace(action.request, placement_preset=self.spec.placement.preset)
            action = msgspec.structs.replace(action, request=placed)
        self.actions.append(action)
        self.primary_actions += 0 if spare else 1

    def relabel(self, m: Member, config: MachineConfig, reason: str, *, spare: bool = False) -> None:
        """Update `m`'s labels in place: no restart."""
        self.add(
            Update(id=m.id, region=self.region, worker_id=m.worker_id, restarts=False, config=config, reason=reason),
            spare=spare,
        )

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
