"""The proxy's settings, read by each of its parts, and the port a machine is reached on.

Its own module so that the parts (`server`, `pick`, `ahead`, `forward`, `failover`) read the same
settings without importing each other.
"""

from __future__ import annotations

import msgspec

from bus.contract.machines import MachineIndexEntry
from orchestrator.proxy.routes import App


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    region: str
    domain: str = "localhost"  # local: <app>.localhost resolves to this host; an edge of a fleet sets --domain
    # `--machine-host` (deprecated): every machine's port is dialed at this host, whatever its worker's address;
    # None: each machine where its worker says (its own host's loopback here, else the worker's backhaul)
    machine_host: str | None = None
    backhaul_always: bool = False  # through the backhaul even to a worker on this host (tests, benchmarks)
    latency: dict[str, float] = {}  # region -> milliseconds from this proxy's region
    head_timeout: float = 10.0  # a request head must arrive whole within this (slowloris)
    keepalive_timeout: float = 75.0  # an idle client connection is closed after this
    response_timeout: float = 60.0  # for the machine's response head
    queue_timeout: float = 5.0  # how long a request waits for a slot when every machine is at its hard limit
    max_queue: int = 1024  # requests waiting per app; more are a 503 at once
    ready_timeout: float = 10.0  # a machine started for a request must accept connections within this
    avoid_for: float = 5.0  # seconds a machine that refused a connection is avoided


def machine_port(app: App, entry: MachineIndexEntry) -> int:
    """The app's internal port, else the one the machine's entry names (0: none known)."""
    return int(app.service.internal_port or entry.port or 0)
