"""The machine manager's settings: what this worker is (its id, region, size) and how its machines run.

Its own module so the manager's parts (reservation, launch spec) read the same settings without importing
the manager that wires them together.
"""

from __future__ import annotations

import msgspec

from workers.lifecycle.restart_policy import Backoff


class ManagerConfig(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    region: str
    cpus: int
    memory_mb: int
    data_dir: str
    backoff: Backoff = Backoff()
    check_host: str = "127.0.0.1"  # local: a worker's health check runs on the machine's own host
    stop_timeout: float = 10.0
    run_as: tuple[int, int] | None = None  # (uid, gid) of the worker's --machine-user
    address: str | None = None  # the worker's advertised address, shown on each of its machines
