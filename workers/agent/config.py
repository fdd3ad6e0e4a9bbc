"""What a worker agent is started with: the CLI (`fauxmad worker`) builds it, the agent only reads it."""

from __future__ import annotations

import msgspec

from bus.local.ports import PortRange
from bus.transport.jetstream import JOBS_ACK_WAIT
from workers.lifecycle.restart_policy import Backoff
from workers.offers import Backpressure


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    region: str
    worker_id: str
    cpus: int
    memory_mb: int
    data_dir: str
    heartbeat_interval: float = 1.0
    backoff: Backoff = Backoff()
    backpressure: Backpressure = Backpressure()
    log_keep_last: int = 100_000
    destroyed_retention: float = 24 * 3600.0
    compact_every: float = 60.0
    fsync: bool = True
    map_size: int = 8 * 1024 * 1024 * 1024
    secrets_key: str | None = None  # the fleet's secrets key (base64), else the credentials file's, else none
    image_cache_mb: int = 4096  # unpacked images kept on disk (least recently used go first)
    # (uid, gid) machines run as (`--machine-user`), so they cannot read the worker's files: its
    # credentials, its LMDB; None: the worker's own user
    machine_user: tuple[int, int] | None = None
    volume_capacity_gb: int | None = None  # volumes' sizes this worker may hold; None: the data dir's free disk
    job_slots: int = 0  # background jobs held at once (0: one per cpu); see workers/jobs
    jobs_ack_wait: float = JOBS_ACK_WAIT
    # whether this worker takes background jobs: false for every logical worker of a process but its first (a
    # simulated fleet's): one job puller per process, not one per logical worker (issue 44)
    serve_jobs: bool = True
    # the address other hosts reach this worker at (None: the local address of its NATS connection)
    advertise: str | None = None
    backhaul_port: int = 0  # where the backhaul listens on `advertise` (0: a free port, said in the heartbeat)
    # the ports its machines' `PORT` is picked in (`--machine-ports LOW-HIGH`); None: the machines' half of the
    # host's range (bus.local.ports)
    machine_ports: PortRange | None = None
