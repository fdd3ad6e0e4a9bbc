"""A whole fleet on one machine: embedded NATS, real worker processes per region, and brokers.

Used by `fauxmad dev`, `fauxmad demo`, `fauxmad bench` and the tests. Workers and brokers are
separate processes started through the CLI (`python -m orchestrator.cli worker|broker`), exactly
as on real hosts, so the orchestrator never imports `workers`. Stopping the fleet destroys the
machines it ran (workers deliberately leave machines running when they stop), then the processes,
then NATS, and checks that nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import nats

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.errors import Unreachable
from bus.contract.machines import DestroyRequest, ListRequest
from bus.local.embedded import EmbeddedNats
from bus.local.ports import PortRange, free_port, machine_slices
from bus.local.supercluster import LoopbackCluster, LoopbackSupercluster
from bus.stores.images import Images
from bus.stores.secrets import new_private_key, secrets_bucket
from bus.stores.snapshots import snapshot_store, volumes_bucket
from bus.transport import credentials
from bus.transport.connection import servers
from bus.transport.credentials import CREDS_ENV
from bus.transport.fleet_layout import Told, fleet_layout
from bus.transport.jetstream import (
    ensure_audit_stream,
    ensure_fleet_resources,
    ensure_jobs_resources,
    revoked_tokens_bucket,
)
from bus.transport.layout import REPLICAS_ENV
from bus.transport.layout import SUPERCLUSTER_ENV as SUPERCLUSTER_LAYOUT_ENV
from bus.transport.nats_adapter import Nats
from orchestrator.devhosts import Host, Hosts
from orchestrator.security.fleetdir import FleetDir
from orchestrator.security.roles import Role

SECURE_ENV = "FAUXMAD_DEV_SECURE"
# `$FAUXMAD_DEV_SUPERCLUSTER=N`: dev fleets run as a supercluster of N servers per region (to run the test suite
# on one, as $FAUXMAD_DEV_SECURE does for secure fleets)
SUPERCLUSTER_ENV = "FAUXMAD_DEV_SUPERCLUSTER"


# a secure dev fleet's identities for the services a person runs beside it: `fauxmad proxy` and `fauxmad api`
SERVICE_IDENTITIES: dict[str, Role] = {"proxy-1": "proxy", "api-1": "api"}


def _supercluster_default() -> int:
    text = os.environ.get(SUPERCLUSTER_ENV, "").strip()
    return int(text) if text.isdigit() else 0


ROOT = Path(__file__).resolve().parent.parent
DESTROY_ALL_WITHIN = 30.0  # seconds a fleet's stop spends destroying machines politely (the rest are killed)

# Called with each fleet just before its stop removes its own directory, logs and all: the test suite keeps a
# failing test's fleets' logs this way (tests/conftest.py), since a fleet stopped inside a test is gone by the
# time the test is known to have failed. A person's `fauxmad dev` registers none.
BEFORE_REMOVAL: list[Callable[[DevFleet], None]] = []


async def _quiet(exc: Exception) -> None:
    pass


class FleetSpec(msgspec.Struct, frozen=True, kw_only=True):
    regions: list[str] = msgspec.field(default_factory=lambda: ["mad", "syd", "gru"])
    workers_per_region: int = 3
    cpus: int = 4
    memory_mb: int = 4096
    port: int | None = None
    brokers: int = 1
    workers_per_process: int = 1
    deadline_ms: float = 50.0
    strategy: str = "scatter"
    heartbeat: float = 1.0
    data_dir: str | None = None
    fsync: bool = True
    nats_sync: bool = True  # False: nats-server's default flush (benchmarks only: see `fauxmad bench jobs`)
    # the same setup a production fleet gets (orchestrator/security): mutual TLS, an identity per process;
    # $FAUXMAD_DEV_SECURE=1 makes it the default (to run the test suite against secure fleets)
    secure: bool = os.environ.get(SECURE_ENV) == "1"
    # servers per region of a supercluster (docs/how-to/supercluster.md): 0 = one nats-server (the default);
    # 3 = the deployed layout (R3 inside each region); 1 = the same shape, lighter
    supercluster: int = msgspec.field(default_factory=_supercluster_default)
    operators: bool = False  # start `fauxmad reconcile --watch` (one per region in a supercluster)
    # servers of one plain NATS cluster (routes, no gateways: the usual HA setup), 0 = one nats-server; no layout
    # variable is set: the fleet's layout takes R3 from a cluster of three (`bus.transport.fleet_layout`)
    cluster: int = 0
    replicas: int | None = None  # the layout's replicas when the fleet is made (None: what the servers offer)
    # local: each worker and broker process serves Prometheus /metrics on a free port of 127.0.0.1 (one host)
    metrics: bool = False
    # N hosts of their own (`orchestrator.devhosts`: network namespaces on a bridge, root and Linux only): host a
    # runs nats-server, the brokers, the operator and the edge proxy; the workers go round the other hosts; the
    # CLI stays in the root namespace (the laptop), which reaches every host's address. 0: all on loopback
    hosts: int = 0
    # worker id -> its host's clock offset under libfaketime (Debian's `faketime`), e.g. "+3s" or "-30s": the
    # worker and its machines see a wall clock that far off (their monotonic clock is left alone)
    skew: dict[str, str] = {}
    # a supercluster's WAN: seconds one way added on every gateway link (`bus.local.gateway_relay`)
    wan_delay: float = 0.0
    # region -> the address its workers advertise (`fauxmad worker --advertise`), e.g. 127.0.0.2 for a region an
    # edge on this host must reach through the workers' backhaul, as a host of its own (default: NATS's side)
    advertise: dict[str, str] = {}


FAKETIME_LIBRARY = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"


def skewed_clock(offset: str) -> dict[str, str]:
    """The environment that runs a process with its wall clock `offset` off (libfaketime: "+3s", "-30s")."""
    found = [p for p in (Path(FAKETIME_LIBRARY), *Path("/usr/lib").glob("*/faketime/libfaketime.so.1")) if p.exists()]
    if not found:
        raise ValueError("a skewed clock needs libfaketime (Debian's `faketime` package)")
    return {"LD_PRELOAD": str(found[0]), "FAKETIME": offset, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def unmount_under(root: Path) -> int:
    """Unmount (lazily) every mount point below `root`, deepest first; returns how many."""
    prefix = str(root.resolve()) + "/"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return 0
    points = [line.split()[4].replace("\\040", " ") for line in lines if len(line.split()) > 4]
    mine = sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)
    for point in mine:
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return len(mine)


class DevFleet:
    running: ClassVar[set[DevFleet]] = set()  # the fleets of this process started and not stopped yet

    def __init__(self, spec: FleetSpec, *, progress: Callable[[str], None] = lambda line: None) -> None:
        self.spec = spec
        self.progress = progress
        self._creds_before: tuple[str | None] | None = None  # ($FAUXMAD_CREDS,) before a secure suite run set it
        self._own_dir = spec.data_dir is None
        self.root = Path(spec.data_dir) if spec.data_dir else Path(tempfile.mkdtemp(prefix="fauxmad-dev-"))
        self.nats: EmbeddedNats | None = None
        self.supercluster: LoopbackSupercluster | None = None
        self.cluster: LoopbackCluster | None = None
        self._layout_before: dict[str, str | None] | None = None  # the layout variables before this fleet set them
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.worker_ids: list[str] = []
        self.commands: dict[str, list[str]] = {}
        self.security: FleetDir | None = None
        self.security_port: int | None = None
        self._creds: dict[str, str] = {}  # process name -> its credentials file (secure fleets)
        self.metrics: dict[str, int] = {}  # process name -> the port of its /metrics (FleetSpec.metrics)
        # worker process -> the ports its machines get (one slice each: no two workers on one loopback pick one port)
        self.machine_ports: dict[str, PortRange] = {}
        self.hosts: Hosts | None = None  # FleetSpec.hosts
        self.placement: dict[str, Host] = {}  # process name -> the host it runs on (FleetSpec.hosts)
        self.edge: str | None = None  # HOST:PORT of the edge proxy a fleet of hosts runs on host a

    @property
    def operator_creds(self) -> str | None:
        """The operator's credentials file of a secure fleet (what a person exports as $FAUXMAD_CREDS)."""
        return str(self.security.creds("operator")) if self.security is not None else None

    def creds_of(self, name: str) -> str | None:
        """A secure fleet's credentials file of identity `name` (`proxy-1`, `api-1`, ...), None on an open fleet."""
        return str(self.security.creds(name)) if self.security is not None else None

    async def _connect(self, **options: Any) -> Any:
        """A raw connection to this fleet for the fleet's own chores (as the operator when secure)."""
        if self.security is None:
            # quiet: nats-py logs every server of a list it could not reach (after a Ctrl-C, all of them)
            return await nats.connect(servers(self.url), **{"error_cb": _quiet, **options})
        return await nats.connect(servers(self.url), **{"error_cb": _quiet, **options, **self._operator_options()})

    def _operator_options(self) -> dict[str, Any]:
        """nats-py's connect options of a secure fleet's operator identity (TLS files, nkey)."""
        assert self.security is not None
        creds, base = credentials.load(self.security.creds("operator"))
        return creds.connect_options(base)

    @property
    def url(self) -> str:
        """Where clients connect: the server, or in a supercluster the first region's servers."""
        if self.supercluster is not None:
            return self.supercluster.urls(self.spec.regions[0])
        if self.cluster is not None:
            return self.cluster.url
        assert self.nats is not None
        return self.nats.url

    def region_url(self, region: str) -> str:
        """The servers of `region` (comma-separated), or the one server."""
        return self.supercluster.urls(region) if self.supercluster is not None else self.url

    @property
    def expected_workers(self) -> int:
        return len(self.spec.regions) * self.spec.workers_per_region

    def _spawn(self, name: str, args: list[str]) -> None:
        log_path = self.root / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.pop(CREDS_ENV, None)
        if name in self._creds:
            env[CREDS_ENV] = self._creds[name]
        offset = self.spec.skew.get(name.removeprefix("worker-")) if name.startswith("worker-") else None
        if offset is not None:
            env.update(skewed_clock(offset))
        argv = [sys.executable, "-m", "orchestrator.cli", *args]
        if name in self.placement:
            argv = self.placement[name].command(argv)
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(self.root),
            )
        self.processes.append((name, proc))
        self.commands[name] = args

    def log_files(self) -> list[Path]:
        """The fleet's logs: each process's (`logs/<name>.log`) and each nats-server's, relative to `root`."""
        found = [*self.root.glob("logs/*.log"), *self.root.glob("nats/**/*.log")]
        return sorted(path.relative_to(self.root) for path in found if path.is_file())

    def kill(self, name: str) -> None:
        """SIGKILL one process of the fleet (`worker-mad-w1`, `broker-1`): chaos on demand."""
        for known, proc in self.processes:
            if known == name and proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def kill_host(self, worker_id: str) -> None:
        """A host dies: its worker and every machine process it ran are SIGKILLed at once."""
        self.kill(f"worker-{worker_id}")
        self._kill_machines(self.root / "workers" / worker_id)

    def respawn(self, name: str) -> None:
        """Start a killed process again with the same arguments (a worker re-adopts its machines)."""
        self.processes = [(n, p) for n, p in self.processes if n != name or p.poll() is None]
        self._spawn(name, self.commands[name])

    def start(self, timeout: float = 60.0) -> DevFleet:
        """Start NATS, the workers and the brokers; on any failure (or Ctrl-C) stop what started, remove the
        data directory if it is this fleet's own, and raise."""
        spec = self.spec
        DevFleet.running.add(self)
        try:
            if spec.hosts:
                self.hosts = Hosts(spec.hosts).up()
                self.progress(
                    f"{spec.hosts} hosts on bridge {self.hosts.bridge}: "
                    + ", ".join(f"{h.name} {h.address}" for h in self.hosts.hosts)
                    + f"; this machine is {self.hosts.gateway}"
                )
            if spec.supercluster or spec.cluster:
                self._start_supercluster() if spec.supercluster else self._start_cluster()
                self._start_processes()
                self._wait_ready(timeout)
                return self
            config = self._secure_setup() if spec.secure else None
            port = self.security_port if config else spec.port
            on = self.hosts.hosts[0] if self.hosts is not None else None
            self.nats = EmbeddedNats(
                port=port or (4222 if on is not None else None),  # a host of its own: the standard port is free
                host=on.address if on is not None else "127.0.0.1",  # one host: the dev fleet's own NATS, local
                store_dir=self.root / "nats",
                name="fauxmad-dev",
                config_file=config,
                sync_always=self.spec.nats_sync,
                wrap=on.command([]) if on is not None else None,
            )
            try:
                self.nats.start()
            except Unreachable as exc:
                raise Unreachable(self._nats_failure(exc)) from None
            self.progress(f"nats-server with JetStream at {self.url}" + (" (mutual TLS, nkey users)" if config else ""))
            if config:
                asyncio.run(self._prepare())
                self._act_as_operator()
            self._start_processes()
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_supercluster(self) -> None:
        """A cluster per region on loopback, joined by gateways (relayed, so a region can be cut off); the layout
        variables set for this process and every process of the fleet; the fleet's buckets and streams made."""
        spec = self.spec
        self.supercluster = LoopbackSupercluster(
            spec.regions,
            spec.supercluster,
            root=self.root / "nats",
            relays=True,
            secure_dir=self.root / "secure" if spec.secure else None,
            host=self.hosts.gateway if self.hosts is not None else "127.0.0.1",  # the relays: on the laptop
            hosts=self._server_hosts(),
            delay=spec.wan_delay,
        )
        self._layout_before = {name: os.environ.get(name) for name in (SUPERCLUSTER_LAYOUT_ENV, REPLICAS_ENV)}
        os.environ[SUPERCLUSTER_LAYOUT_ENV] = ",".join(spec.regions)
        os.environ[REPLICAS_ENV] = str(min(3, spec.supercluster))
        if spec.secure:  # identities after the layout is set: a worker's permissions name its region's buckets
            self._secure_setup(url=self.supercluster.urls(spec.regions[0]))
            self.supercluster.connect_options = self._operator_options()
        self.supercluster.start()
        self.progress(
            f"{len(spec.regions)} NATS clusters of {spec.supercluster} server(s) joined by gateways"
            + (" (mutual TLS, nkey users)" if spec.secure else "")
            + ": "
            + "; ".join(f"{r} at {self.region_url(r)}" for r in spec.regions)
        )
        asyncio.run(self._prepare_supercluster())
        self._act_as_operator()

    def _start_cluster(self) -> None:
        """One plain cluster of `spec.cluster` servers on loopback (routes, no gateways), no layout variable set:
        the fleet's layout comes from what the servers offer; the fleet's buckets and streams made."""
        spec = self.spec
        self.cluster = LoopbackCluster(
            spec.cluster,
            root=self.root / "nats",
            secure_dir=self.root / "secure" if spec.secure else None,
            hosts=self._server_hosts(),
        )
        if spec.secure:
            self._secure_setup(url=self.cluster.url)
            self.cluster.connect_options = self._operator_options()
        self.cluster.start()
        self.progress(
            f"a NATS cluster of {spec.cluster} servers"
            + (" (mutual TLS, nkey users)" if spec.secure else "")
            + f" at {self.cluster.url}"
        )
        asyncio.run(self._prepare_supercluster())
        self._act_as_operator()

    def _server_hosts(self) -> list[tuple[str, list[str]]]:
        """Where a cluster's servers go round (a fleet of hosts: every host in turn, from a), else nowhere."""
        return [(h.address, h.command([])) for h in self.hosts.hosts] if self.hosts is not None else []

    async def _prepare_supercluster(self, timeout: float = 60.0) -> None:
        """Create the fleet's buckets and streams once JetStream has elected its leaders (a few seconds)."""
        servers = self.supercluster or self.cluster
        assert servers is not None
        await servers.jetstream_ready(timeout)
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._prepare()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise Unreachable(
                        f"the supercluster's JetStream did not come up within {timeout:g}s: {exc!r}"
                    ) from None
                await asyncio.sleep(0.5)

    def _secure_setup(self, url: str | None = None) -> Path:
        """A secure fleet's directory (CA, certificates, users) with an identity for every process to come;
        `url`: the servers the credentials name (a supercluster's first region), else the one server's."""
        spec = self.spec
        if spec.workers_per_process > 1:
            raise ValueError("a secure dev fleet runs one worker per process (each worker is an identity)")
        self.security_port = spec.port or (4222 if self.hosts is not None else free_port())
        if url is None and self.hosts is not None:  # one server, on host a
            url = f"tls://{self.hosts.hosts[0].address}:{self.security_port}"
        self.security = FleetDir(self.root / "secure")
        # a fleet of hosts: the servers' certificates name every host's address (a server may run on any of them)
        addresses = tuple(h.address for h in self.hosts.hosts) if self.hosts is not None else ()
        self.security.init(port=self.security_port, url=url, server_names=addresses)
        for region in spec.regions:
            for n in range(spec.workers_per_region):
                worker_id = f"{region}-w{n + 1}"
                addresses = (spec.advertise.get(region, "127.0.0.1"),)  # local: a dev fleet's NATS is on loopback
                self._creds[f"worker-{worker_id}"] = str(self.security.add_worker(worker_id, region, addresses))
        scopes = [f"{region}-" for region in spec.regions] if spec.supercluster else [""]
        for scope in scopes:  # a supercluster's brokers are per region (`broker-mad-1`)
            for i in range(spec.brokers):
                name = f"broker-{scope}{i + 1}"
                self._creds[name] = str(self.security.add_user(name, "broker"))
            # the operator process (`fauxmad reconcile --watch`) acts as the fleet's operator identity
            self._creds[f"operator-{scope}".rstrip("-")] = str(self.security.creds("operator"))
        for name, role in SERVICE_IDENTITIES.items():  # for processes a person starts: the edge and the HTTP API
            self.security.add_user(name, role)
        if self.hosts is not None:  # the edge on host a runs as the proxy identity, as a team runs it
            self._creds["proxy"] = str(self.security.creds("proxy-1"))
        return self.security.config

    def _act_as_operator(self) -> None:
        """The suite in secure mode: its clients (this process's and the CLIs it runs) act as the operator."""
        if self.security is not None and os.environ.get(SECURE_ENV) == "1":
            self._creds_before = (os.environ.get(CREDS_ENV),)
            os.environ[CREDS_ENV] = str(self.operator_creds)

    async def _prepare(self) -> None:
        """Create the fleet's streams and buckets as the operator: in a secure fleet the others only bind."""
        nc = await self._connect()
        try:
            if self.spec.replicas is not None:  # written before anything else: the fleet's layout
                await fleet_layout(nc.jetstream(), Told(replicas=self.spec.replicas, source="the dev fleet's spec"))
            await ensure_fleet_resources(nc.jetstream(), every_region=True)
            await secrets_bucket(nc.jetstream())
            await ensure_audit_stream(nc.jetstream())
            await revoked_tokens_bucket(nc.jetstream())
            await Images.open(nc.jetstream())
            await snapshot_store(nc.jetstream())
            await volumes_bucket(nc.jetstream())
            for region in self.spec.regions:
                await ensure_jobs_resources(nc.jetstream(), region)
        finally:
            await nc.close()

    def _nats_failure(self, exc: Unreachable) -> str:
        """Why nats-server did not start, from its log (which `stop` is about to remove with the data dir)."""
        assert self.nats is not None
        try:
            lines = self.nats.log_file.read_text(errors="replace").splitlines()
        except OSError:
            return exc.message
        errors = [line for line in lines if "[FTL]" in line or "[ERR]" in line]
        if not errors:
            return exc.message
        why = errors[-1].split("] ", 2)[-1].strip()
        return f"nats-server could not start on port {self.nats.port}: {why}"

    def _secrets_key(self) -> Path:
        """The dev fleet's secrets key (one for all its workers, so `fauxmad secrets` works out of the box)."""
        path = self.root / "secrets.key"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(new_private_key() + "\n")
        return path

    def _host_for(self, name: str, number: int | None = None) -> None:
        """Put process `name` on a host (a fleet of hosts): worker `number` (0-based) on the hosts after `a` in
        turn, everything else on `a`."""
        if self.hosts is None:
            return
        hosts = self.hosts.hosts
        if number is None or len(hosts) == 1:
            self.placement[name] = hosts[0]
        else:
            self.placement[name] = hosts[1 + number % (len(hosts) - 1)]

    def _start_processes(self) -> None:
        spec = self.spec
        secrets_key = self._secrets_key()
        for region in spec.regions:
            per = spec.workers_per_process
            groups = (spec.workers_per_region + per - 1) // per
            for group in range(groups):
                count = min(per, spec.workers_per_region - group * per)
                base = f"{region}-{group + 1}" if per > 1 else f"{region}-w{group + 1}"
                ids = [base] if count == 1 else [f"{base}-{i:04d}" for i in range(count)]
                self.worker_ids += ids
                args = [
                    "worker",
                    "--nats",
                    self.region_url(region),
                    "--region",
                    region,
                    "--worker-id",
                    base,
                    "--cpus",
                    str(spec.cpus),
                    "--memory-mb",
                    str(spec.memory_mb),
                    "--data-dir",
                    str(self.root / "workers" / base),
                    "--heartbeat",
                    str(spec.heartbeat),
                    "--secrets-key",
                    str(secrets_key),
                    "--max-load",  # simulated hosts on one kernel: its load average is none of theirs
                    "0",
                ]
                if count > 1:
                    args += ["--count", str(count)]
                self.machine_ports[base] = machine_slices().take()
                args += ["--machine-ports", str(self.machine_ports[base])]
                if region in spec.advertise:
                    args += ["--advertise", spec.advertise[region]]
                if not spec.fsync:
                    args += ["--no-fsync"]
                self._host_for(f"worker-{base}", len(self.worker_ids) - len(ids))
                self._spawn(f"worker-{base}", args + self._metrics_args(f"worker-{base}"))
        # one set of brokers (and an operator) for the fleet, or in a supercluster per region, connected to it
        agent_regions: list[str | None] = list(spec.regions) if self.supercluster is not None else [None]
        for scope in agent_regions:
            where = ["--nats", self.region_url(scope), "--region", scope] if scope else ["--nats", self.url]
            for i in range(spec.brokers):
                name = f"broker-{scope}-{i + 1}" if scope else f"broker-{i + 1}"
                args = ["broker", *where, "--name", name, "--deadline-ms", str(spec.deadline_ms)]
                self._host_for(name)
                self._spawn(name, [*args, "--strategy", spec.strategy, *self._metrics_args(name)])
            if spec.operators:
                self._host_for(f"operator-{scope}" if scope else "operator")
                self._spawn(f"operator-{scope}" if scope else "operator", ["reconcile", "--watch", *where])
        if self.hosts is not None:  # the edge on host a, as a team puts its edge on a host of its own
            edge = self.hosts.hosts[0].address
            self.edge = f"{edge}:8080"
            self._host_for("proxy")
            self._spawn(
                "proxy",
                [
                    "proxy",
                    "--nats",
                    self.url,
                    "--region",
                    spec.regions[0],
                    "--listen",
                    self.edge,
                    "--admin",
                    f"{edge}:9091",
                ],
            )
        self.progress(
            f"{self.expected_workers} workers in {', '.join(spec.regions)} and {self.expected_brokers} broker(s)"
            + (f", an operator {'per region' if self.supercluster else ''}".rstrip() if spec.operators else "")
        )

    def _metrics_args(self, name: str) -> list[str]:
        """`--metrics-listen` on a free port for process `name` when the spec asks for metrics, else nothing."""
        if not self.spec.metrics:
            return []
        self.metrics[name] = free_port()
        return ["--metrics-listen", f"127.0.0.1:{self.metrics[name]}"]  # local: a dev fleet is one host

    @property
    def expected_brokers(self) -> int:
        return self.spec.brokers * (len(self.spec.regions) if self.spec.supercluster else 1)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout

        async def counts() -> tuple[int, int]:
            nc = await self._connect()
            try:
                msg = await nc.request(subjects.API_WORKERS_LIST, b"", timeout=1)
                workers = len(msgspec.json.decode(msg.data)) if not msg.headers else 0
                pings = 0
                inbox = nc.new_inbox()
                sub = await nc.subscribe(inbox)
                await nc.publish(f"$SRV.PING.{subjects.BROKER_SERVICE}", b"", reply=inbox)
                # every pong expected, or a wait long enough for one from a region a WAN away (a gap of 0.2 s
                # between pongs missed every other region's at 150 ms one way: the fleet never came up)
                until = time.monotonic() + 0.5 + 4 * self.spec.wan_delay
                with contextlib.suppress(Exception):
                    while pings < self.expected_brokers and (left := until - time.monotonic()) > 0:
                        await sub.next_msg(timeout=left)
                        pings += 1
                return workers, pings
            except Exception:
                return 0, 0
            finally:
                await nc.close()

        while time.monotonic() < deadline:
            for name, proc in self.processes:
                if proc.poll() is not None:
                    tail = (self.root / "logs" / f"{name}.log").read_text(errors="replace")[-1500:]
                    raise Unreachable(f"{name} exited with code {proc.returncode}: {tail.strip()}")
            workers, brokers = asyncio.run(counts())
            if workers >= self.expected_workers and brokers >= self.expected_brokers and self._edge_up():
                return
            time.sleep(0.1)
        raise Unreachable(f"the fleet did not come up within {timeout:g}s (see {self.root / 'logs'})")

    def _edge_up(self) -> bool:
        """Whether the edge proxy of a fleet of hosts accepts connections (True when there is none)."""
        if self.edge is None:
            return True
        host, port = self.edge.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except OSError:
            return False
        return True

    # ------------------------------------------------------------------------------------------
    def destroy_all_machines(self) -> int:
        """Destroy every machine on every worker of this fleet (workers leave machines running on exit)."""

        destroyed = 0

        async def destroy(nc: Nats, worker_id: str, machine_id: str, limit: asyncio.Semaphore) -> None:
            nonlocal destroyed
            async with limit:
                with contextlib.suppress(Exception):
                    request = encode(DestroyRequest(id=machine_id, force=True))
                    await nc.request(subjects.worker_machines(worker_id, "destroy"), request, timeout=10)
                    destroyed += 1

        async def run() -> None:
            # fail fast: after a Ctrl-C the whole process group (nats-server too) may be gone already
            nc = await self._connect(connect_timeout=1, allow_reconnect=False)
            limit = asyncio.Semaphore(32)  # hundreds of machines after a load test: not one after another
            try:
                for worker_id in self.worker_ids:
                    try:
                        msg = await nc.request(
                            subjects.worker_machines(worker_id, "list"), encode(ListRequest()), timeout=2
                        )
                        machines = msgspec.json.decode(msg.data) if not msg.headers else []
                    except Exception:
                        continue
                    await asyncio.gather(*(destroy(nc, worker_id, m["id"], limit) for m in machines))
            finally:
                await nc.close()

        # bounded: what is left is killed by `_kill_leftover_machines` when the workers are gone
        with contextlib.suppress(Exception):
            asyncio.run(asyncio.wait_for(run(), DESTROY_ALL_WITHIN))
        return destroyed

    def _kill_untracked_children(self) -> None:
        """Our own children that name this fleet's directory but were never recorded: a Ctrl-C that landed
        between a `Popen` and the line that records it. Left alone, such a worker would re-create the
        directory after it is removed and reconnect forever."""
        me, root = os.getpid(), str(self.root).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == me and root in (entry / "cmdline").read_bytes():
                    pid = int(entry.name)
                    os.kill(pid, signal.SIGKILL)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)

    def _kill_leftover_machines(self) -> None:
        """Last resort: any machine process still running under this fleet's data dir."""
        self._kill_machines(self.root / "workers")

    @staticmethod
    def _kill_machines(under: Path) -> None:
        for pid_file in under.glob("**/machines/*/child.pid"):
            with contextlib.suppress(Exception):
                pid = int(pid_file.read_text().strip())
                shim = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                if shim > 1 and shim != os.getpid():
                    os.kill(shim, signal.SIGKILL)  # the machine's supervisor, in its own session
                os.killpg(os.getpgid(pid), signal.SIGKILL)

    def stop(self) -> None:
        try:
            self._stop_processes()
        finally:  # even when interrupted (a test's timeout): the environment this process shares goes back
            self._restore_layout_env()
            self._restore_creds_env()
            for part in self.machine_ports.values():
                machine_slices().give_back(part)
            self.machine_ports.clear()
        self._kill_untracked_children()
        if self.hosts is not None:  # whatever is left inside the hosts is killed with them
            self.hosts.down()
            self.hosts = None
        DevFleet.running.discard(self)
        if self._own_dir:
            for keep in BEFORE_REMOVAL:
                with contextlib.suppress(Exception):  # keeping logs must never stop a fleet from stopping
                    keep(self)
            # volumes' loop mounts (docs/tutorials/images-and-volumes.md): freed with their loop devices
            unmount_under(self.root)
            shutil.rmtree(self.root, ignore_errors=True)

    def _stop_processes(self) -> None:
        nats_alive = (self.nats is not None and self.nats.process is not None and self.nats.process.poll() is None) or (
            self.supercluster is not None or self.cluster is not None
        )
        if nats_alive and self.processes:
            destroyed = self.destroy_all_machines()
            if destroyed:
                self.progress(f"destroyed {destroyed} machines")
        for _, proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for _, proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()
        self._kill_leftover_machines()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.supercluster is not None:
            self.supercluster.stop()
            self.supercluster = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    def _restore_creds_env(self) -> None:
        if self._creds_before is not None:  # put back what the secure suite mode changed
            (before,) = self._creds_before
            if before is None:
                os.environ.pop(CREDS_ENV, None)
            else:
                os.environ[CREDS_ENV] = before
            self._creds_before = None

    def _restore_layout_env(self) -> None:
        """Put back the layout variables a supercluster fleet set for its lifetime."""
        for name, before in (self._layout_before or {}).items():
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
        self._layout_before = None

    def __enter__(self) -> DevFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
