"""The driver interface (after Nomad's `DriverPlugin`): how the worker runs a machine's workload.

The worker only ever talks to a driver through this Protocol, so the process driver of today and a
VM or container driver of tomorrow are interchangeable. A `TaskHandle` is everything needed to find
a running task again after the worker restarts; the worker persists it in LMDB with the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import msgspec


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to run for one machine."""

    machine_id: str
    cmd: list[str]
    env: dict[str, str]
    workdir: str
    memory_mb: int
    cpus: int
    cwd: str | None = None  # where `cmd` runs (`config.workdir`); None: `workdir`, the machine's own directory
    sandbox: str = "none"  # "bwrap": in namespaces of its own (workers/driver/sandbox.py)
    image_root: str | None = None  # the unpacked image it runs in: shared, read-only in a sandbox
    # (uid, gid) the workload runs as (the worker's --machine-user), None: the worker's own user
    run_as: tuple[int, int] | None = None
    volumes: list[tuple[str, str]] = []  # (host directory, mount path): bound at the path in a sandbox

    @property
    def home(self) -> str:
        """The machine's writable directory: its own, or below it one the machine's user owns (the
        machine's own holds the shim's files, which the workload must not be able to rewrite)."""
        return self.workdir if self.run_as is None else f"{self.workdir}/home"

    @property
    def run_dir(self) -> str:
        return self.cwd or self.home


class TaskHandle(msgspec.Struct, frozen=True, kw_only=True):
    """How to find a task again: persisted with the machine, handed back to `recover` after a restart.

    `start_ticks` is the process start time from /proc/<pid>/stat, which tells a live task from an
    unrelated process that happens to reuse its pid.
    """

    pid: int
    start_ticks: int
    workdir: str
    cgroups: list[str] = []
    started_at: float = 0.0

    @property
    def status_path(self) -> Path:
        return Path(self.workdir) / "exit.json"

    @property
    def stdout_path(self) -> Path:
        return Path(self.workdir) / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        return Path(self.workdir) / "stderr.log"


class ExitStatus(msgspec.Struct, frozen=True, kw_only=True):
    """How a task ended. `lost`: it ended while nobody watched and left no status behind."""

    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    lost: bool = False
    finished_at: float = 0.0

    @property
    def success(self) -> bool:
        return self.exit_code == 0 and not self.oom_killed and not self.lost


class TaskState(msgspec.Struct, frozen=True, kw_only=True):
    running: bool
    pid: int
    child_pid: int | None = None
    rss_bytes: int | None = None
    exit: ExitStatus | None = None
    stopped: bool = False  # the workload is in a job-control stop (SIGSTOP): a suspended machine's process


class Driver(Protocol):
    """Nomad-like verbs. `start` returns as soon as the task exists; `wait` resolves when it ends."""

    name: str

    async def start(self, spec: TaskSpec) -> TaskHandle: ...

    async def wait(self, handle: TaskHandle) -> ExitStatus: ...

    async def stop(self, handle: TaskHandle, timeout: float, signal: int) -> ExitStatus: ...

    async def signal(self, handle: TaskHandle, signal: int) -> None: ...

    async def destroy(self, handle: TaskHandle, force: bool) -> None: ...

    def inspect(self, handle: TaskHandle) -> TaskState: ...

    def recover(self, handle: TaskHandle) -> bool: ...

    async def end_strays(self, machine_id: str) -> int:
        """Kill any run of `machine_id` that no handle names (left by a worker killed mid-start)."""
        ...
