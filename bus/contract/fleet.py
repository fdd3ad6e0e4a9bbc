"""The fleet as brokers show it: a worker's heartbeat (`WorkerInfo`, KV `fauxmad_workers` and
`worker.<id>.info`), and the brokers' API (`fauxmad.v1.api.*`): create, simulate, regions, workers, cordon.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from bus.contract.base import Name, Reply, Request, Token
from bus.contract.machines import Guest, MachineConfig
from bus.contract.offers import Resources


class WorkerInfo(Reply):
    worker_id: str
    region: str
    capacity: Resources
    used: Resources
    machines: int = 0
    cordoned: bool = False
    images: list[str] = []
    load: float = 0.0
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    states: dict[str, int] = {}
    limits: str = ""
    pid: int = 0
    log_seq: int = 0
    # addition: machines per app (what an offer's app_machines says), for placement from the replica
    app_machines: dict[str, int] = {}
    sandboxes: list[str] = []  # addition: as an offer's
    # additions (docs/tutorials/images-and-volumes.md): the volumes' sizes it may hold, and holds
    volume_capacity_gb: int = 0
    volume_used_gb: int = 0
    # additions (data plane across hosts): the address other hosts reach this worker at, and the port of its
    # backhaul, where an edge on another host asks for a machine's port (0: none; an older worker)
    address: str = ""
    backhaul: int = 0
    # addition (skewed clocks): how far this worker's clock is ahead of its NATS server's (negative: behind), as
    # last measured (`workers.agent.heartbeat`); past `MAX_CLOCK_SKEW` it reserves nothing
    clock_skew: float = 0.0


# How a broker finds candidates: ask the region (`scatter`), ask two sampled workers (`p2c`), `scatter` and
# reserve on the best two at once (`hedged`), or ask nobody and rank the workers' heartbeats (`replica`,
# an addition). The broker's own strategy is the default.
Strategy = Literal["scatter", "p2c", "hedged", "replica"]


# An app's placement policy, `[placement] preset` in fauxmad.toml (docs/explanation/placement.md: the curves).
Preset = Literal["balanced", "binpack", "spread"]


class CreateRequest(Request):
    region: Token
    config: MachineConfig
    name: Name | None = None
    skip_launch: bool = False
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    explain: bool = False
    strategy: Strategy | None = None
    # addition: workers that must not get this machine (a spare away from its primary, a drained host)
    avoid_workers: list[Token] = []
    # addition: workers it should get only if no other has room (a penalty in the ranking, not a filter)
    prefer_away: list[Token] = []
    # addition: the app's placement policy, `[placement] preset` in fauxmad.toml (None: the broker's curves)
    placement_preset: Preset | None = None


class SimulateRequest(Request):
    """A dry-run placement: which worker would win, and why. Nothing is reserved."""

    app: Token
    region: Token
    guest: Guest = msgspec.field(default_factory=Guest)
    image: str | None = None
    strategy: Strategy | None = None
    placement_preset: Preset | None = None


class WorkersListRequest(Request):
    region: Token | None = None


class RegionSummary(Reply):
    region: str
    workers: int
    cordoned: int
    capacity: Resources
    used: Resources
    machines: int
    # in a supercluster: False when the region's cluster does not answer (cut off, or down: from outside the two
    # look the same, so nothing of it is moved); an addition to the contract, absent (true) on one server
    reachable: bool = True


class InfoRequest(Request):
    """`info` takes no fields: an empty payload or `{}`."""


class RegionsListRequest(Request):
    """`regions.list` takes no fields: an empty payload or `{}` (anything else is a 400, not ignored)."""


class CordonRequest(Request):
    reason: str = ""
