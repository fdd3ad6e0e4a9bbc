"""Per-machine memory and CPU limits: cgroup v2, cgroup v1, or rlimits, detected once at start-up.

Why it exists: a machine over its memory must be killed *and reported as such*, and machines on one
host must share CPU in proportion to what they reserved. The kernel does both with cgroups; where
the worker cannot create cgroups (no controller, no permission) it falls back to RLIMIT_AS, which
bounds memory but cannot tell an OOM kill from an ordinary failure.

Key decisions:

- `auto_detect` tries each mode for real (create a probe cgroup, write a limit, remove it) instead
  of trusting what is mounted: hybrid hosts mount an empty unified hierarchy next to v1 controllers,
  and containers often mount cgroupfs read-only. It leaves nothing behind; the worker's base
  directory appears with its first machine. Control files are opened without O_CREAT, so a plain
  directory can never pass for a cgroup.
- Layout `<root>/fauxmad/<base_name>/<machine_id>`, so several workers on one host never collide and
  an operator can see at a glance what belongs to fauxmad.
- Creating a cgroup is the slow part, so `prepare` takes one made ahead from a small pool
  (workers/driver/cgroup_pool.py: `<base>/_pool-<hex>`, renamed after the machine, limits preset for the
  last size asked for) and creates one only when the pool is empty or the machine's cgroup exists
  already (a restart reuses it). Probing (`auto_detect`) and the rlimit mode never start a pool.
- Memory: the limit is `memory_mb`, swap is not allowed (v1 `memsw` = the limit, v2 `swap.max` = 0),
  so an oversized machine is OOM-killed rather than swapping the host to death. v2 also sets
  `memory.oom.group`, so an OOM kills the whole machine and not a random process inside it.
- CPU: a proportional weight (v1 `cpu.shares` = 1024 per cpu, v2 `cpu.weight` = 100 per cpu), not a
  hard quota: idle capacity stays usable, contended capacity is shared by reservation.
- OOM detection reads the kernel's `oom_kill` counter for the machine's cgroup; only when a kernel has
  no such counter does a hit on the memory limit plus SIGKILL count as an OOM kill.
- The shim (not this module) moves the workload into the cgroups, before exec, so no workload code
  ever runs outside its limits. `cleanup` kills stragglers left in a cgroup (daemons the workload
  spawned) so the directory can be removed.
"""

from __future__ import annotations

import contextlib
import os
import signal as signals
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol

from workers.driver.cgroup_pool import CgroupPool

Mode = Literal["cgroup2", "cgroup1", "rlimit"]

MIB = 1024 * 1024
PROBE = "_probe"
V1_SHARES_PER_CPU = 1024
V1_SHARES_MAX = 262144
V2_WEIGHT_PER_CPU = 100
V2_WEIGHT_MAX = 10000
MOUNTINFO = "/proc/self/mountinfo"


class Limits(Protocol):
    """What the driver needs: set up a machine's limits, read whether it was OOM-killed, clean up."""

    mode: Mode

    def describe(self) -> str: ...

    def prepare(self, machine_id: str, memory_mb: int, cpus: int) -> list[str]:
        """Create the machine's cgroups with its limits; return the directories to join."""
        ...

    def oom_killed(self, cgroups: Sequence[str], signal: int | None) -> bool:
        """Whether the kernel OOM-killed something in these cgroups; `signal` is how the task ended."""
        ...

    def cleanup(self, cgroups: Sequence[str]) -> None:
        """Kill what is left in the cgroups and remove them; busy or missing ones are ignored.
        May block for up to a second (call it from a thread in async code)."""
        ...

    def rlimit_as(self, memory_mb: int) -> int | None:
        """The RLIMIT_AS to give the workload, or None when cgroups do the job."""
        ...

    def release_pool(self) -> None:
        """Remove the cgroups made ahead for future machines (see workers/driver/cgroup_pool.py), when the
        driver stops starting machines; a later `prepare` fills the pool again."""
        ...

    def close(self) -> None:
        """Remove this worker's (empty) base directories, when the worker shuts down for good. The
        shared `fauxmad` level stays: another worker may be creating its base under it right now."""
        ...


# ---------------------------------------------------------------------------------------------------
# small file helpers


def _write(path: Path, value: str) -> None:
    """Write a control file that must already exist: never create one (a plain directory mistaken
    for a cgroup would otherwise silently "accept" every limit)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _require_cgroup(directory: Path) -> None:
    if not (directory / "cgroup.procs").is_file():
        raise OSError(f"{directory} is not a cgroup directory")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_keyed(path: Path, key: str) -> int | None:
    """A `key value` line from files such as memory.oom_control and memory.events."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


def _kill_members(cgroup: Path) -> None:
    """SIGKILL every process still in the cgroup (v2 has cgroup.kill; v1 must walk cgroup.procs)."""
    kill_file = cgroup / "cgroup.kill"
    if kill_file.exists():
        with contextlib.suppress(OSError):
            _write(kill_file, "1")
        return
    try:
        pids = (cgroup / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid), signals.SIGKILL)


def _remove(cgroup: Path, patience: float = 1.0) -> None:
    """rmdir, retried for a moment: it fails with EBUSY until a just-killed process has fully exited
    (freeing a large address space takes milliseconds). Still busy after that: left for later."""
    deadline = time.monotonic() + patience
    while True:
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)


def _mounts(mountinfo: str) -> Iterator[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) for each mount, from /proc/self/mountinfo."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        rest = tail.split()
        if len(parts) < 5 or len(rest) < 3:
            continue
        yield parts[4].replace("\\040", " "), rest[0], set(rest[2].split(","))


def _checked(name: str) -> str:
    """Machine ids and base names become directory names: they must not point anywhere else."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} cannot name a cgroup")
    return name


def _weight(cpus: int, per_cpu: int, low: int, high: int) -> int:
    return max(low, min(high, per_cpu * max(1, cpus)))


# ---------------------------------------------------------------------------------------------------
# cgroup v2


class Cgroup2Limits:
    """Unified hierarchy: one directory per machine with memory (and cpu when delegated)."""

    mode: Mode = "cgroup2"

    def __init__(self, root: str, base_name: str) -> None:
        self.root = Path(root)
        self.base = self.root / "fauxmad" / _checked(base_name)
        self.cpu = False
        self.pool = CgroupPool(self._apply)

    def __repr__(self) -> str:
        return f"Cgroup2Limits(base={str(self.base)!r}, cpu={self.cpu})"

    def describe(self) -> str:
        return self.mode

    def setup(self) -> None:
        """Create the base directories and delegate the controllers down to the machines' level."""
        _require_cgroup(self.root)
        available = set((self.root / "cgroup.controllers").read_text().split())
        if "memory" not in available:
            raise OSError("memory controller not available in the unified hierarchy")
        self.cpu = "cpu" in available
        wanted = "+memory +cpu" if self.cpu else "+memory"
        self.base.mkdir(parents=True, exist_ok=True)
        for level in (self.root, self.root / "fauxmad", self.base):
            enabled = set((level / "cgroup.subtree_control").read_text().split())
            if "memory" not in enabled or (self.cpu and "cpu" not in enabled):
                _write(level / "cgroup.subtree_control", wanted)

    def machine_dirs(self, machine_id: str) -> list[str]:
        return [str(self.base / machine_id)]

    def prepare(self, machine_id: str, memory_mb: int, cpus: int) -> list[str]:
        cgroup = self.base / _checked(machine_id)
        if not self.base.is_dir():
            self.setup()
        if not cgroup.exists():
            pooled = self.pool.claim([self.base], machine_id, memory_mb, cpus)
            if pooled is not None:
                return [str(directory) for directory in pooled]
        return self.make(machine_id, memory_mb, cpus)

    def make(self, machine_id: str, memory_mb: int, cpus: int) -> list[str]:
        """`prepare` without the pool: create (or reuse) the machine's cgroup and write its limits."""
        cgroup = self.base / _checked(machine_id)
        cgroup.mkdir(exist_ok=True)
        self._apply([cgroup], memory_mb, cpus)
        return [str(cgroup)]

    def _apply(self, dirs: list[Path], memory_mb: int, cpus: int) -> None:
        [cgroup] = dirs
        _write(cgroup / "memory.max", str(memory_mb * MIB))
        for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
            if (cgroup / name).exists():
                _write(cgroup / name, value)
        if self.cpu:
            weight = _weight(cpus, V2_WEIGHT_PER_CPU, 1, V2_WEIGHT_MAX)
            _write(cgroup / "cpu.weight", str(weight))

    def oom_killed(self, cgroups: Sequence[str], signal: int | None) -> bool:
        for cgroup in map(Path, cgroups):
            kills = _read_keyed(cgroup / "memory.events", "oom_kill")
            if kills is not None:
                return kills > 0
            events = _read_keyed(cgroup / "memory.events", "max")
            if events and signal == signals.SIGKILL:
                return True
        return False

    def cleanup(self, cgroups: Sequence[str]) -> None:
        for cgroup in map(Path, cgroups):
            _kill_members(cgroup)
            _remove(cgroup)

    def rlimit_as(self, memory_mb: int) -> int | None:
        return None

    def release_pool(self) -> None:
        self.pool.release()

    def close(self) -> None:
        self.pool.release()
        with contextlib.suppress(OSError):
            self.base.rmdir()


# ---------------------------------------------------------------------------------------------------
# cgroup v1


class Cgroup1Limits:
    """Legacy hierarchies: a directory per machine under the memory mount, and under the cpu one."""

    mode: Mode = "cgroup1"

    def __init__(self, memory_root: str, cpu_root: str | None, base_name: str) -> None:
        self.memory_base = Path(memory_root) / "fauxmad" / _checked(base_name)
        self.cpu_base = Path(cpu_root) / "fauxmad" / base_name if cpu_root else None
        self.pool = CgroupPool(self._apply)

    def __repr__(self) -> str:
        return f"Cgroup1Limits(memory={str(self.memory_base)!r}, cpu={str(self.cpu_base)!r})"

    def describe(self) -> str:
        return self.mode

    def setup(self) -> None:
        _require_cgroup(self.memory_base.parent.parent)
        self.memory_base.mkdir(parents=True, exist_ok=True)
        if self.cpu_base is not None:
            try:
                _require_cgroup(self.cpu_base.parent.parent)
                self.cpu_base.mkdir(parents=True, exist_ok=True)
            except OSError:
                self.cpu_base = None  # memory limits without CPU weights beat no limits at all

    def machine_dirs(self, machine_id: str) -> list[str]:
        bases = (self.memory_base, self.cpu_base)
        return [str(base / machine_id) for base in bases if base is not None]

    def _bases(self) -> list[Path]:
        return [base for base in (self.memory_base, self.cpu_base) if base is not None]

    def prepare(self, machine_id: str, memory_mb: int, cpus: int) -> list[str]:
        _checked(machine_id)
        if not self.memory_base.is_dir() or (self.cpu_base is not None and not self.cpu_base.is_dir()):
            self.setup()
        # (No check whether the machine's cgroups exist: the rename fails if they do.)
        pooled = self.pool.claim(self._bases(), machine_id, memory_mb, cpus)
        if pooled is not None:
            return [str(directory) for directory in pooled]
        return self.make(machine_id, memory_mb, cpus)

    def make(self, machine_id: str, memory_mb: int, cpus: int) -> list[str]:
        """`prepare` without the pool: create (or reuse) the machine's cgroups and write its limits."""
        dirs = [base / _checked(machine_id) for base in self._bases()]
        for directory in dirs:
            directory.mkdir(exist_ok=True)
        self._apply(dirs, memory_mb, cpus)
        return [str(directory) for directory in dirs]

    def _apply(self, dirs: list[Path], memory_mb: int, cpus: int) -> None:
        """Limits into [memory] or [memory, cpu] directories."""
        self._set_memory(dirs[0], memory_mb * MIB)
        if len(dirs) > 1:
            _write(dirs[1] / "cpu.shares", str(_weight(cpus, V1_SHARES_PER_CPU, 2, V1_SHARES_MAX)))

    @staticmethod
    def _set_memory(cgroup: Path, limit: int) -> None:
        """memory.limit <= memory.memsw.limit must hold at every step, so the order depends on
        whether a re-used cgroup's limit goes up or down: try lowering order first, then raising."""
        files = [cgroup / "memory.limit_in_bytes"]
        memsw = cgroup / "memory.memsw.limit_in_bytes"
        if memsw.exists():
            files.append(memsw)
        try:
            for path in files:
                _write(path, str(limit))
        except OSError:
            for path in reversed(files):
                _write(path, str(limit))

    def oom_killed(self, cgroups: Sequence[str], signal: int | None) -> bool:
        for cgroup in map(Path, cgroups):
            if not (cgroup / "memory.oom_control").exists():
                continue  # the cpu hierarchy's directory
            kills = _read_keyed(cgroup / "memory.oom_control", "oom_kill")
            if kills is not None:
                return kills > 0
            failures = _read_int(cgroup / "memory.failcnt")
            return bool(failures) and signal == signals.SIGKILL
        return False

    def cleanup(self, cgroups: Sequence[str]) -> None:
        for cgroup in map(Path, cgroups):
            _kill_members(cgroup)
            _remove(cgroup)

    def rlimit_as(self, memory_mb: int) -> int | None:
        return None

    def release_pool(self) -> None:
        self.pool.release()

    def close(self) -> None:
        self.pool.release()
        for base in (self.memory_base, self.cpu_base):
            if base is not None:
                with contextlib.suppress(OSError):
                    base.rmdir()


# ---------------------------------------------------------------------------------------------------
# rlimit fallback


class RlimitLimits:
    """No cgroups: bound the workload's address space. No CPU weights, no OOM reporting (a workload
    hitting RLIMIT_AS sees allocation failures and usually exits with an error of its own)."""

    mode: Mode = "rlimit"

    def __repr__(self) -> str:
        return "RlimitLimits()"

    def describe(self) -> str:
        return self.mode

    def prepare(self, machine_id: str, memory_mb: int, cpus: int) -> list[str]:
        return []

    def oom_killed(self, cgroups: Sequence[str], signal: int | None) -> bool:
        return False

    def cleanup(self, cgroups: Sequence[str]) -> None:
        return None

    def rlimit_as(self, memory_mb: int) -> int | None:
        return memory_mb * MIB if memory_mb > 0 else None

    def release_pool(self) -> None:
        return None

    def close(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------------
# detection


def _cgroup2_candidate(base_name: str, mountinfo: str) -> Cgroup2Limits | None:
    for mount_point, fs_type, _ in _mounts(mountinfo):
        if fs_type == "cgroup2":
            controllers = Path(mount_point) / "cgroup.controllers"
            with contextlib.suppress(OSError):
                if "memory" in controllers.read_text().split():
                    return Cgroup2Limits(mount_point, base_name)
    return None


def _cgroup1_candidate(base_name: str, mountinfo: str) -> Cgroup1Limits | None:
    memory_root: str | None = None
    cpu_root: str | None = None
    for mount_point, fs_type, options in _mounts(mountinfo):
        if fs_type != "cgroup":
            continue
        if "memory" in options and memory_root is None:
            memory_root = mount_point
        if "cpu" in options and cpu_root is None:
            cpu_root = mount_point
    if memory_root is None:
        return None
    return Cgroup1Limits(memory_root, cpu_root, base_name)


def _works(limits: Cgroup2Limits | Cgroup1Limits) -> bool:
    """Set up the base directories, create, limit and remove a probe machine, remove the base again
    (the first `prepare` recreates it): detecting leaves nothing behind."""
    try:
        limits.setup()
        limits.cleanup(limits.make(PROBE, 64, 1))  # not `prepare`: probing must not start the pool
        return True
    except OSError:
        limits.cleanup(limits.machine_dirs(PROBE))
        return False
    finally:
        limits.close()


FAVOR_DYNMODS = "favordynmods"


def slow_migration_hint(mountinfo: str = MOUNTINFO) -> str | None:
    """A one-line hint when moving a process into a cgroup pays an RCU grace period, else None.

    Every start moves the machine's process into its cgroups. The kernel guards that with one global
    per-CPU rwsem whose writer waits for an RCU grace period: 8 to 13 ms per start measured here, most of
    what a start adds after the worker's reply. `favordynmods` on the cgroup2 mount (Linux 6.0+, and global:
    it covers v1 hierarchies too) makes the writer cheap (0.4 to 0.6 ms here) for a little cost to forks."""
    for mount_point, fs_type, options in _mounts(mountinfo):
        if fs_type == "cgroup2":
            if FAVOR_DYNMODS in options:
                return None
            return (
                "starting a machine waits ~10 ms to join its cgroups: "
                f"`mount -o remount,{FAVOR_DYNMODS} {mount_point}` (Linux 6.0+; deploy/systemd/fauxmad-worker.service "
                "does it) makes that ~0.5 ms"
            )
    return None


def auto_detect(base_name: str, mountinfo: str = MOUNTINFO) -> Limits:
    """The best mode this host allows, tried for real: cgroup v2, then v1, then rlimits.

    `base_name` names this worker's subtree (one per worker on a host); `mountinfo` is where mounts
    are read from (tests point it elsewhere to exercise the fallbacks).
    """
    candidates = (_cgroup2_candidate(base_name, mountinfo), _cgroup1_candidate(base_name, mountinfo))
    for candidate in candidates:
        if candidate is not None and _works(candidate):
            return candidate
    return RlimitLimits()
