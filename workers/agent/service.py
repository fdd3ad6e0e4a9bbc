"""The worker agent: connects to the bus, wires the machine manager, its volumes and its jobs to it, and serves.

Subscriptions: `fauxmad.v1.offers.<region>` (plain, not a queue group: every worker of the region
answers the auction, inline, from numbers it already has), and a NATS micro service
`fauxmad-worker` whose endpoints are this worker's machine verbs, `info`, `cordon` and `uncordon`
(so `$SRV.PING/INFO/STATS` discovery lists workers too). `workers.agent.handlers` answers them
through the `Responder` edge; NATS types stop there.

After each commit the outbox (`workers.outbox`) delivers the transition to stream `FAUXMAD_EVENTS`
and keeps the KV routing index `fauxmad_machines` current, in commit order, without holding up the
reply, retrying until NATS takes it; on start it republishes what the stream may have missed. A create's
audit record goes to the audit stream the same way, from its own lane (`workers.audit_outbox`). The
heartbeat (`workers.agent.heartbeat`) puts `WorkerInfo` into KV `fauxmad_workers` every second.
Stopping the agent never stops its machines: they are re-adopted on restart.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from nacl.public import PrivateKey
from nats.aio.client import Client
from nats.js.errors import APIError
from nats.micro import add_service
from nats.micro.service import ServiceConfig

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.errors import FauxmadError
from bus.contract.fleet import WorkerInfo
from bus.contract.machines import Machine
from bus.contract.offers import Resources
from bus.contract.streams import LogLine
from bus.contract.verbs import WORKER_REQUESTS, WORKER_VOLUME_REQUESTS
from bus.stores.secrets import load_private_key, secrets_bucket
from bus.stores.snapshots import snapshot_store
from bus.transport import credentials
from bus.transport.addresses import source_address_for_url
from bus.transport.audit import AuditTrail, RequestAudit
from bus.transport.connection import connect
from bus.transport.jetstream import FleetConfig, FleetKV, ensure_fleet_resources_patiently
from bus.transport.nats_adapter import JetStream
from bus.transport.service import Responder
from workers import metrics
from workers.agent.backhaul import Backhaul
from workers.agent.claims import region_claims
from workers.agent.compaction import compact_forever
from workers.agent.config import WorkerConfig
from workers.agent.handlers import Handlers
from workers.agent.heartbeat import BeatGroup, Heartbeat
from workers.agent.images import images_in_use, images_named, open_image_cache
from workers.audit_outbox import AuditOutbox
from workers.driver import sandbox
from workers.driver.limits import auto_detect, slow_migration_hint
from workers.driver.process import ProcessDriver
from workers.image_cache import ImageCache
from workers.jobs.service import JobsService
from workers.lifecycle.fence import Fence
from workers.lifecycle.manager import MachineManager, ManagerConfig
from workers.lifecycle.tally import MachineTally
from workers.log.commit import GroupCommitter
from workers.log.records import ImageRecord, LogRecord, MachineRecord, VolumeRecord
from workers.log.store import Store
from workers.offers import Snapshot
from workers.outbox import Outbox
from workers.output import LogFollower
from workers.secrets import SecretsCache
from workers.volumes.storage import VolumeFs
from workers.volumes.verbs import VolumeManager

log = logging.getLogger(__name__)

VERSION = "0.1.0"
JOBS_RETRY = 5.0  # seconds between tries to start background jobs that could not start with the worker


def cgroup_base_name(worker_id: str, data_dir: Path) -> str:
    """This worker's subtree of the host's cgroups: its id and a digest of its data directory. Worker ids are
    unique in a fleet, not on a host: two fleets on one host (two `fauxmad dev`, tests side by side) each have a
    `mad-w1`, and sharing `fauxmad/mad-w1` let one worker's pool adopt or remove the other's pooled cgroups as a
    crashed worker's leftovers, and two machines claim one (stops then hung, tests side by side failed). The same
    data directory, after a restart, gives the same name."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]
    return f"{worker_id}-{digest}"


class Shared:
    """What the logical workers of one process share (`workers.agent.runner`, issue 44); a real fleet's worker, alone
    in its process, shares nothing. `nc`: the process's NATS connection (its runner closes it); `beats`: the one
    heartbeat timer; `secrets`: the one watched copy of the fleet's secrets, the first worker's (it closes it)."""

    def __init__(self, nc: Client, beats: BeatGroup) -> None:
        self.nc = nc
        self.beats = beats
        self.secrets: SecretsCache | None = None


class WorkerAgent:
    def __init__(self, config: WorkerConfig, shared: Shared | None = None) -> None:
        """`shared`: what this logical worker shares with the others of its process (None: a worker of its own)."""
        subjects.check_token("region", config.region)
        subjects.check_token("worker id", config.worker_id)
        self.config = config
        self.shared = shared
        self.beats = shared.beats if shared is not None else None
        self._owns_secrets = True
        self.started_at = time.time()
        self.nc: Client | None = None
        self.store: Store | None = None
        self.committer: GroupCommitter | None = None
        self.manager: MachineManager | None = None
        self.driver: ProcessDriver | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.outbox: Outbox | None = None
        self.audits: AuditOutbox | None = None  # the creates' audit records, to the audit stream
        self._audit_nc: Client | None = None  # the audit outbox's own connection (a worker of its own process)
        self._idle_drop: asyncio.TimerHandle | None = None  # acked audit rows deleted alone if nothing commits
        self._service: Any = None
        self._subs: list[Any] = []
        self._images: frozenset[str] = frozenset()
        self._kv: FleetKV | None = None
        self.heartbeat: Heartbeat | None = None
        self.resumed: dict[str, int] = {}
        self._stopped = asyncio.Event()
        self._closing = False
        self.bus_lost: str | None = None  # why the bus connection ended for good, if it did
        self.limits_mode = ""
        self._sandboxes = tuple(sandbox.available())  # looked up once: offers are answered inline
        self.tally = MachineTally()
        self.image_cache: ImageCache | None = None
        self.volumes: VolumeManager | None = None
        self._states_seen: set[str] = set()  # for the per-state gauge
        self._committed = 0  # commit hooks run (`offer_state`)
        self.jobs: JobsService | None = None
        self.address = config.advertise or ""  # the address other hosts reach this worker at (`start`)
        self.backhaul: Backhaul | None = None

    # ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        data = Path(cfg.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        if cfg.machine_user is not None:  # machines pass through to their own directories, and see nothing else
            for private in (data, data / "machines"):
                private.mkdir(exist_ok=True)
                private.chmod(0o711)
        # no server at start: one line and exit 3, as every command (docs/reference/exit-codes.md#stopping);
        # once connected it reconnects forever, as an agent does
        shared = self.shared
        if shared is not None:  # the process's, for its logical workers (`workers.agent.runner`)
            self.nc = shared.nc
        else:
            self.nc = await connect(
                cfg.nats_url, f"fauxmad-worker-{cfg.worker_id}", reconnect_forever=True, on_closed=self.on_bus_closed
            )
        self.address = cfg.advertise or _nats_source_address(self.nc, cfg.nats_url)
        js = self.nc.jetstream()
        kv = self._kv = await ensure_fleet_resources_patiently(
            js, FleetConfig(heartbeat_interval=cfg.heartbeat_interval, region=cfg.region)
        )
        self.heartbeat = Heartbeat(
            self.nc,
            kv,
            region=cfg.region,
            worker_id=cfg.worker_id,
            interval=cfg.heartbeat_interval,
            info=self.info,
            spawn=self._spawn,
            on_return=lambda: self._spawn(self._sweep_fenced("after an absence")),
        )
        heartbeat = self.heartbeat
        fence = Fence(
            region_claims(kv, cfg.region),
            cfg.worker_id,
            absences=lambda: heartbeat.absences,
            away=heartbeat.away,
            clock=time.time,
        )
        if shared is not None and shared.secrets is not None:  # the process's first worker watches for all
            self.secrets, self._owns_secrets = shared.secrets, False
        else:
            self.secrets = SecretsCache(_secrets_key(cfg), saved=data / "secrets.sealed.json")
            await self.secrets.start(await secrets_bucket(js))
            if shared is not None:
                shared.secrets = self.secrets
        layout = kv.layout  # in a supercluster: this region's own index bucket and events stream
        self.outbox = Outbox(
            self.nc,
            worker_id=cfg.worker_id,
            index_bucket=layout.machines_bucket(cfg.region),
            events_stream=layout.events_stream(cfg.region),
            address=self.address,
            machines=self._machines_now,
        )
        self.store = Store(data / "lmdb", sync=cfg.fsync, map_size=cfg.map_size)
        if shared is None:
            # its own connection: nats-server stores what one connection publishes in order, so the audit records'
            # fsyncs would delay the index entries a reserve's answer waits for (docs/benchmarks.md, 2026-11-29)
            name = f"fauxmad-worker-{cfg.worker_id}-audit"
            self._audit_nc = await connect(cfg.nats_url, name, reconnect_forever=True)
        self.audits = AuditOutbox(self._audit_nc or self.nc, worker_id=cfg.worker_id, delivered=self._audits_delivered)
        self.audits.restore(self.store.audits_to_deliver())  # what the last run kept and did not see acked
        # before anything of this run commits: what the last run's outbox held in memory may never have
        # reached the stream (deliveries wait for the look-ups, and resumed machines commit below)
        self._tasks.append(self.outbox.republish(self.store.machines()))
        self.committer = GroupCommitter(self.store)
        limits = auto_detect(cgroup_base_name(cfg.worker_id, data))
        self.limits_mode = limits.describe()
        hint = slow_migration_hint() if limits.describe() != "rlimit" else None
        if hint is not None:
            log.warning("worker %s: %s", cfg.worker_id, hint)
        driver = self.driver = ProcessDriver(limits)
        store = self.store
        self.image_cache = await open_image_cache(
            js, data / "images", quota_bytes=cfg.image_cache_mb << 20, in_use=lambda: images_in_use(store)
        )
        volumes = self.volumes = await self._volume_manager(js, data)
        self.manager = MachineManager(
            ManagerConfig(
                worker_id=cfg.worker_id,
                region=cfg.region,
                cpus=cfg.cpus,
                memory_mb=cfg.memory_mb,
                data_dir=str(data),
                backoff=cfg.backoff,
                run_as=cfg.machine_user,
                address=self.address,
            ),
            self.store,
            self.committer,
            driver,
            on_commit=self._on_commit,
            on_launch=self._follow_logs,
            secret_env=self.secrets.env_for,
            held_ports=lambda: self.tally.ports,
            port_range=cfg.machine_ports,
            images=self.image_cache,
            volumes=self.volumes,
            fence=fence,
            skewed=heartbeat.skewed,
        )
        self._images = frozenset(self.store.images())
        # derived from LMDB at start and kept in step by _on_commit: info() must not scan every machine
        self.tally = MachineTally(stored.machine for stored in self.store.machines())
        self.follower = LogFollower(
            self._publish_log,
            region=cfg.region,
            worker_id=cfg.worker_id,
            connected=lambda: self.nc is not None and self.nc.is_connected,
        )
        handlers = Handlers(  # its routes are checked against the contract here, before anything is served
            manager=self.manager,
            volumes=volumes,
            follower=self.follower,
            committer=self.committer,
            backpressure=cfg.backpressure,
            snapshot=self.snapshot,
            state=self.offer_state,
            info=self.info,
            put_heartbeat=self.heartbeat.put,
            routed=self.outbox.routed,
        )
        volumes_recovered = await volumes.recover()  # before machines: theirs must be mounted
        await self._sweep_fenced("at start")  # before machines are launched again: a fenced one must not be
        self.resumed = await self.manager.readopt()
        if volumes_recovered:
            log.info("worker %s: volumes %s", cfg.worker_id, volumes_recovered)
        for stored in self.store.machines():
            if stored.machine.state == "started":
                self.follower.follow(
                    stored.machine.id, stored.machine.app, self.manager.workdir(stored.machine.id), from_offset_now=True
                )
        await self._start_backhaul()  # before the first heartbeat, which says its port
        await self._start_jobs()  # before the info endpoint answers: a ready worker takes jobs
        await self._subscribe(handlers)
        await self._first_beat()
        if self.beats is None:  # else the process's one timer beats for it (`heartbeat.BeatGroup`)
            self._tasks.append(asyncio.create_task(self.heartbeat.run()))
        self._tasks += [
            asyncio.create_task(self.outbox.run()),
            asyncio.create_task(self.audits.run()),
            asyncio.create_task(self.follower.run()),
            asyncio.create_task(compact_forever(self.store, cfg)),
        ]
        log.info("worker %s in %s up: resumed %s, limits %s", cfg.worker_id, cfg.region, self.resumed, self.limits_mode)

    async def _volume_manager(self, js: JetStream, data: Path) -> VolumeManager:
        """Volumes under `<data>/volumes`, with the backend this host allows (`workers.volumes.storage.detect`)."""
        assert self.store is not None and self.committer is not None
        root = data / "volumes"
        capacity = self.config.volume_capacity_gb
        if capacity is None:
            capacity = max(1, shutil.disk_usage(data).free >> 30)
        manager = VolumeManager(
            worker_id=self.config.worker_id,
            region=self.config.region,
            capacity_gb=capacity,
            store=self.store,
            committer=self.committer,
            fs=VolumeFs(root),
            js=js,
            snapshots=await snapshot_store(js),
            scratch=data,
        )
        manager.on_commit = self._on_commit
        return manager

    async def _subscribe(self, handlers: Handlers) -> None:
        assert self.nc is not None
        cfg = self.config
        self._subs.append(
            await self.nc.subscribe(subjects.offers(cfg.region), cb=self.responder.for_subscription_now(handlers.offer))
        )
        self._service = await add_service(
            self.nc,
            ServiceConfig(
                name=subjects.WORKER_SERVICE,
                version=VERSION,
                description="fauxmad worker agent: the source of truth for the machines on one host",
                metadata={"worker_id": cfg.worker_id, "region": cfg.region},
            ),
        )
        endpoints = {
            "machines": (subjects.worker_machines_wildcard(cfg.worker_id), handlers.on_machines),
            "volumes": (subjects.worker_volumes_wildcard(cfg.worker_id), handlers.on_volumes),
            "offer": (subjects.worker_offer(cfg.worker_id), handlers.on_offer),
            "info": (subjects.worker_info(cfg.worker_id), handlers.on_info),
            "cordon": (subjects.worker_cordon(cfg.worker_id, True), handlers.on_cordon),
            "uncordon": (subjects.worker_cordon(cfg.worker_id, False), handlers.on_cordon),
        }
        described_by = {
            "machines": [f"worker_machines_{verb}" for verb in WORKER_REQUESTS],
            "volumes": [f"worker_volumes_{verb}" for verb in WORKER_VOLUME_REQUESTS],
        }
        for name, (subject, handler) in endpoints.items():
            described = described_by.get(name, [f"worker_{name}"])
            await self.responder.add_endpoint(self._service, name, subject, handler, described)
        await self.nc.flush()

    async def _first_beat(self) -> None:
        """The first heartbeat. A workers bucket that cannot store it now (a cluster just back from losing servers,
        electing its leader: NoStreamResponseError, or no answer) does not end the worker's start, which serves
        already: the heartbeat's loop beats again every interval (nemesis on hosts, seed 106: a worker restarted
        then exited on it and was missing at the end). A logical worker joins its process's beat group first: its
        first beat is its group key's put (`heartbeat.BeatGroup`)."""
        heartbeat = self.heartbeat
        assert heartbeat is not None
        if self.beats is not None:
            self.beats.add(heartbeat)
        try:
            await heartbeat.once()
        except Exception as exc:
            log.warning(
                "worker %s: the first heartbeat was not stored (%r): beating again every %gs",
                self.config.worker_id,
                exc,
                heartbeat.interval,
            )

    async def _start_backhaul(self) -> None:
        """The backhaul (`workers.agent.backhaul`) on the advertised address: mutual TLS with the fleet's CA on a
        secure fleet (the worker's credentials), plain TCP on a dev fleet."""
        assert self.store is not None and self.manager is not None
        manager, store = self.manager, self.store

        def machine(machine_id: str) -> Machine | None:
            stored = store.get(machine_id)
            return None if stored is None else manager.view(stored)

        tls = None
        path = credentials.default_path()
        if path:
            creds, base = credentials.load(path)
            tls = creds.backhaul_server_context(base)
        self.backhaul = Backhaul(machine, tls=tls)
        try:
            await self.backhaul.start(self.address, self.config.backhaul_port)
        except OSError as exc:
            raise FauxmadError(
                f"the backhaul cannot listen on {self.address}:{self.config.backhaul_port}: {exc.strerror or exc}"
                " (see --advertise and --backhaul-port)"
            ) from None

    async def _start_jobs(self) -> None:
        """Background jobs (workers/jobs): this region's job desk, and pulls bounded by free slots. Jobs that cannot
        start now (their streams at home, in a supercluster cut off from the home region: the nemesis on hosts,
        seed 103, where the raw 503 ended the worker) are tried again every JOBS_RETRY seconds; the worker serves
        its machines meanwhile. Not for a logical worker that is not its process's first (`WorkerConfig.serve_jobs`)."""
        assert self.nc is not None
        # its API requests (background jobs' submit and cancel) are recorded in the audit trail, as a broker's
        self.trail = AuditTrail(self.nc)
        await self.trail.make_stream_if_open()
        self.responder = Responder(self.nc, f"worker {self.config.worker_id}", audit=RequestAudit(self.trail))
        if not self.config.serve_jobs:
            return
        if not await self._jobs_started():
            self._tasks.append(asyncio.create_task(self._jobs_later()))

    async def _jobs_started(self, *, quiet: bool = False) -> bool:
        assert self.nc is not None and self.store is not None and self.manager is not None and self._kv is not None
        cfg, store = self.config, self.store
        jobs = JobsService(
            self.nc,
            self.manager,
            worker_id=cfg.worker_id,
            region=cfg.region,
            slots=cfg.job_slots or cfg.cpus,
            free_cpus=lambda: cfg.cpus - store.usage().cpus,
            workers_kv=self._kv.workers,
            ack_wait=cfg.jobs_ack_wait,
        )
        try:
            await jobs.start(self.responder)
        except (FauxmadError, TimeoutError, APIError) as exc:  # not prepared (a secure fleet), or not answering
            if not quiet:
                why = getattr(exc, "message", None) or repr(exc)
                said = f"background jobs off for now: {why} (trying again every {JOBS_RETRY:g}s)"
                log.warning("worker %s: %s", cfg.worker_id, said)
            await jobs.close()
            return False
        self.jobs = jobs
        return True

    async def _jobs_later(self) -> None:
        while True:
            await asyncio.sleep(JOBS_RETRY)
            if await self._jobs_started(quiet=True):
                log.info("worker %s: background jobs on", self.config.worker_id)
                return

    # ------------------------------------------------------------------------------------------
    # what the worker tells the auction (a snapshot) and the registry (its info)

    def snapshot(self) -> Snapshot:
        assert self.store is not None and self.manager is not None and self.heartbeat is not None
        usage = self.store.usage()
        worker = self.store.worker()
        return Snapshot(
            worker_id=self.config.worker_id,
            region=self.config.region,
            capacity=Resources(cpus=self.config.cpus, memory_mb=self.config.memory_mb),
            used=usage.resources(),
            machines=usage.machines,
            cordoned=worker.cordoned,
            images=images_named(self._images, self.image_cache),
            load=self.heartbeat.load,
            inflight=self.manager.inflight,
            app_machines=self.tally.per_app,
            sandboxes=self._sandboxes,
        )

    def offer_state(self) -> tuple[int, int, int, float, int]:
        """Changes whenever what `snapshot` reads may have: a commit (the store's tables: usage, cordon), its hook
        (the tallies and images it keeps, after the commit), a pull or eviction of the image cache, the load of
        the last beat, the launches in flight. An offer is answered again from the same bytes while it holds."""
        assert self.committer is not None and self.heartbeat is not None and self.manager is not None
        cache = self.image_cache
        return (
            self.committer.batches,
            self._committed,
            cache.version if cache is not None else 0,
            self.heartbeat.load,
            self.manager.inflight,
        )

    def info(self) -> WorkerInfo:
        assert self.store is not None
        snap = self.snapshot()
        states = self.tally.state_counts()
        metrics.set_machine_states(states, self._states_seen)
        return WorkerInfo(
            worker_id=snap.worker_id,
            region=snap.region,
            capacity=snap.capacity,
            used=snap.used,
            machines=snap.machines,
            cordoned=snap.cordoned,
            images=sorted(snap.images),
            load=snap.load,
            started_at=self.started_at,
            heartbeat_at=time.time(),
            states=states,
            limits=self.limits_mode,
            pid=os.getpid(),
            log_seq=self.store.last_seq,
            app_machines=dict(snap.app_machines),
            sandboxes=list(snap.sandboxes),
            volume_capacity_gb=self.volumes.capacity_gb if self.volumes else 0,
            volume_used_gb=self.volumes.held_gb() if self.volumes else 0,
            clock_skew=round(self.heartbeat.skew, 3) if self.heartbeat is not None else 0.0,
            address=self.address,
            backhaul=self.backhaul.port if self.backhaul is not None else 0,
        )

    # ------------------------------------------------------------------------------------------
    # after commit: events, routing index, images

    def _audits_delivered(self, seqs: list[int]) -> None:
        """The audit stream acked these create audit records: their rows go with the next commit, or in one of their
        own if the worker commits nothing for a second (checked once a second at most, on the loop's timer)."""
        assert self.store is not None and self.committer is not None
        self.store.audits_delivered(seqs)
        if self._idle_drop is None:
            self._idle_drop = asyncio.get_running_loop().call_later(1.0, self._drop_if_idle, self.committer.batches)

    def _drop_if_idle(self, batches_then: int) -> None:
        self._idle_drop = None
        if self.store is None or self.committer is None or not self.store.delivered_waiting:
            return
        if self.committer.batches == batches_then:
            self.committer.nudge()  # nothing committed for a second: delete them alone
        else:  # acked after the last commit: look again in a second
            self._idle_drop = asyncio.get_running_loop().call_later(1.0, self._drop_if_idle, self.committer.batches)

    def _machines_now(self) -> list[Machine]:
        """Every machine of the log, as it is now (the outbox indexes them again after a reconnect)."""
        return [] if self.store is None else [stored.machine for stored in self.store.machines()]

    def _on_commit(self, records: list[LogRecord]) -> None:
        assert self.outbox is not None
        self._committed += 1  # `offer_state`: what this hook keeps (tallies, images) changes below
        for record in records:
            if isinstance(record, MachineRecord):
                machine = record.stored.machine
                self.tally.update(machine)
                self.outbox.committed(record)
                if self.audits is not None:
                    self.audits.committed(record)
                if record.op in ("reserve", "destroyed", "update") and self.heartbeat is not None:
                    self.heartbeat.usage_changed()  # the registry's usage (workers/agent/heartbeat.py: how soon)
                if machine.state in ("stopped", "failed", "destroyed"):
                    self.follower.unfollow(machine.id)
                if machine.state == "destroyed" and self.jobs is not None:
                    self.jobs.wake()
            elif isinstance(record, ImageRecord):
                self._images = self._images | {record.image}
            elif isinstance(record, VolumeRecord):
                self._beat_soon()  # the registry's volume numbers (the brokers place volumes from them)

    def _follow_logs(self, machine: Machine) -> None:
        """Before a process is spawned: follow its files from their current end, so no line is missed."""
        assert self.manager is not None
        self.follower.follow(machine.id, machine.app, self.manager.workdir(machine.id), from_offset_now=True)

    async def _sweep_fenced(self, when: str) -> None:
        assert self.manager is not None
        counts = await self.manager.sweep_fenced()
        if counts:
            log.info("worker %s: keyed machines asked their claims %s: %s", self.config.worker_id, when, counts)

    def _beat_soon(self) -> None:
        """Usage changed: the registry hears of it soon (`Heartbeat.soon`)."""
        if self.heartbeat is not None:
            self.heartbeat.soon()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A task of the agent's own: cancelled when it closes."""
        self._tasks.append(asyncio.create_task(coro))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _publish_log(self, line: LogLine) -> None:
        assert self.nc is not None
        await self.nc.publish(subjects.logs(line.app, line.machine_id), encode(line))

    # ------------------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    def machines_running(self) -> int:
        """The machines this worker runs (started): what stopping it leaves running."""
        return self.tally.states["started"]

    def on_bus_closed(self, reason: str) -> None:
        """The connection is gone for good (not a reconnect): never stay alive but deaf."""
        if self._closing:
            return
        self.bus_lost = reason
        log.error("worker %s: %s; exiting so that the supervisor restarts it", self.config.worker_id, reason)
        self._stopped.set()

    async def _close_jobs(self) -> None:
        if self.jobs is not None:
            await self.jobs.close()

    async def _close_backhaul(self) -> None:
        if self.backhaul is not None:
            await self.backhaul.close()

    async def _flush_outboxes(self) -> None:
        """What the last commits changed, delivered if NATS takes it soon (bounded: the rest waits for the next start,
        the events looked up in the stream then, the audit records kept in LMDB)."""
        if self.outbox is None or self.nc is None or not self.nc.is_connected:
            return
        await _bounded(self.outbox.flush(), 2.0)
        if self.audits is not None:
            await _bounded(self.audits.flush(), 1.0)

    async def close(self) -> None:
        """Stop serving, promptly: every step is bounded, and machines are left running. Jobs first: a job pulled but
        not started goes back to the queue at once, for another worker (see `JobsService.close`)."""
        await _bounded(self._close_jobs(), 3.0)
        await self._flush_outboxes()
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await _bounded(asyncio.gather(*self._tasks, return_exceptions=True), 2.0)
        if self._service is not None:
            await _bounded(self._service.stop(), 2.0)
        for sub in self._subs:
            await _bounded(sub.unsubscribe(), 1.0)
        if hasattr(self, "responder"):
            await _bounded(self.responder.drain(), 3.0)  # answer what is in flight
            await self.trail.drain()
            self.responder.cancel_all()
        await _bounded(self._close_backhaul(), 1.0)
        if self.manager is not None:
            await _bounded(self.manager.close(), 2.0)
        if hasattr(self, "secrets") and self._owns_secrets:
            await _bounded(self.secrets.close(), 1.0)
        if self.driver is not None:
            self.driver.close()  # its launcher (machines keep running)
        if self.nc is not None and self.shared is None:  # a shared connection is its runner's to close
            await _bounded(self.nc.close(), 2.0)
        if self._audit_nc is not None:
            await _bounded(self._audit_nc.close(), 1.0)
        if self.committer is not None:
            self.committer.close()
        if self.store is not None:
            self.store.close()


def _secrets_key(config: WorkerConfig) -> PrivateKey | None:
    """The fleet's secrets key: the worker's config, else its credentials file's (secure fleets), else none."""
    text = config.secrets_key
    if text is None and credentials.default_path():
        text = credentials.load(credentials.default_path() or "")[0].secrets_key
    return load_private_key(text) if text else None


def _nats_source_address(nc: Client, url: str) -> str:
    """The local address of the worker's NATS connection (the address the kernel picked to reach the server it is
    connected to): what the worker advertises unless told (`--advertise`)."""
    connected = nc.connected_url
    if connected is not None and connected.hostname:
        try:
            return source_address_for_url(f"nats://{connected.hostname}:{connected.port or 4222}")
        except OSError:
            pass
    return source_address_for_url(url)


async def _bounded(awaitable: Any, seconds: float) -> None:
    try:
        await asyncio.wait_for(awaitable, seconds)
    except (TimeoutError, Exception):
        log.debug("shutdown step did not finish within %ss", seconds, exc_info=True)
