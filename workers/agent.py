"""The worker agent process: wires the machine manager to the bus, and beats its heart.

Subscriptions: `fauxmad.v1.offers.<region>` (plain, not a queue group: every worker of the region
answers the auction, inline, from numbers it already has), and a NATS micro service
`fauxmad-worker` whose endpoints are this worker's machine verbs, `info`, `cordon` and `uncordon`
(so `$SRV.PING/INFO/STATS` discovery lists workers too). Every request is answered by the
`Responder` edge; NATS types stop there.

After each commit the outbox (`workers.log.outbox`) delivers the transition to stream `FAUXMAD_EVENTS`
and keeps the KV routing index `fauxmad_machines` current, in commit order, without holding up the
reply, retrying until NATS takes it; on start it republishes what the stream may have missed. A
heartbeat puts `WorkerInfo` into KV `fauxmad_workers` every second; the bucket's TTL makes a dead
worker's key expire. Stopping the agent never stops its machines: they are re-adopted on restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
from nacl.public import PrivateKey
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import BadRequest, FauxmadError, Unreachable
from bus.contract.messages import (
    EMPTY_OK,
    VOLUME_EMPTY_OK,
    WORKER_REQUESTS,
    WORKER_VOLUME_REQUESTS,
    CordonRequest,
    InfoRequest,
    LogLine,
    Machine,
    OfferRequest,
    Resources,
    WorkerInfo,
)
from bus.contract.schema import endpoint_metadata
from bus.stores.images import ImageManifest, Images, image_store, is_digest, tags_bucket
from bus.stores.secrets import load_private_key, secrets_bucket
from bus.stores.snapshots import snapshot_store
from bus.transport import credentials
from bus.transport.audit import AuditTrail, RequestAudit
from bus.transport.connection import connect
from bus.transport.jetstream import JOBS_ACK_WAIT, FleetConfig, ensure_fleet_resources
from bus.transport.service import Responder
from workers import metrics
from workers.driver import sandbox
from workers.driver.limits import auto_detect, slow_migration_hint
from workers.driver.process import ProcessDriver
from workers.image_cache import ImageCache
from workers.jobs.service import JobsService
from workers.lifecycle.manager import MachineManager, ManagerConfig
from workers.lifecycle.restart_policy import Backoff
from workers.lifecycle.tally import MachineTally
from workers.log.commit import GroupCommitter
from workers.log.machine_states import PROCESS_STATES
from workers.log.outbox import Outbox
from workers.log.records import ImageRecord, LogRecord, MachineRecord, VolumeRecord, WorkerState
from workers.log.store import Store
from workers.offers import Backpressure, Snapshot, answer_offer
from workers.output import LogFollower
from workers.secrets import SecretsCache
from workers.volumes.storage import VolumeFs
from workers.volumes.verbs import VolumeManager

log = logging.getLogger(__name__)

VERSION = "0.1.0"


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


class WorkerAgent:
    def __init__(self, config: WorkerConfig) -> None:
        subjects.check_token("region", config.region)
        subjects.check_token("worker id", config.worker_id)
        self.config = config
        self.started_at = time.time()
        self.nc: Client | None = None
        self.store: Store | None = None
        self.committer: GroupCommitter | None = None
        self.manager: MachineManager | None = None
        self.driver: ProcessDriver | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.outbox: Outbox | None = None
        self._service: Any = None
        self._subs: list[Any] = []
        self._images: frozenset[str] = frozenset()
        self._load = 0.0
        self._kv: Any = None
        self.resumed: dict[str, int] = {}
        self._stopped = asyncio.Event()
        self._closing = False
        self.bus_lost: str | None = None  # why the bus connection ended for good, if it did
        self.limits_mode = ""
        self._sandboxes = tuple(sandbox.available())  # looked up once: offers are answered inline
        self._beat_pending = False
        self.tally = MachineTally()
        self.image_cache: ImageCache | None = None
        self.volumes: VolumeManager | None = None
        self._states_seen: set[str] = set()  # for the per-state gauge
        self.jobs: JobsService | None = None

    # ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        data = Path(cfg.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        if cfg.machine_user is not None:  # machines pass through to their own directories, and see nothing else
            for private in (data, data / "machines"):
                private.mkdir(exist_ok=True)
                private.chmod(0o711)
        self.nc = await connect(
            cfg.nats_url, f"fauxmad-worker-{cfg.worker_id}", agent=True, on_closed=self._on_bus_closed
        )
        js = self.nc.jetstream()
        self._kv = await ensure_fleet_resources(
            js, FleetConfig(heartbeat_interval=cfg.heartbeat_interval, region=cfg.region)
        )
        self.secrets = SecretsCache(_secrets_key(cfg))
        await self.secrets.start(await secrets_bucket(js))
        layout = self._kv.layout  # in a supercluster: this region's own index bucket and events stream
        self.outbox = Outbox(
            self.nc,
            worker_id=cfg.worker_id,
            index_bucket=layout.machines_bucket(cfg.region),
            events_stream=layout.events_stream(cfg.region),
        )
        self.store = Store(data / "lmdb", sync=cfg.fsync, map_size=cfg.map_size)
        # before anything of this run commits: what the last run's outbox held in memory may never have
        # reached the stream (deliveries wait for the look-ups, and resumed machines commit below)
        self._tasks.append(self.outbox.republish(self.store.machines()))
        self.committer = GroupCommitter(self.store)
        limits = auto_detect(cfg.worker_id)
        self.limits_mode = limits.describe()
        hint = slow_migration_hint() if limits.describe() != "rlimit" else None
        if hint is not None:
            log.warning("worker %s: %s", cfg.worker_id, hint)
        driver = self.driver = ProcessDriver(limits)
        images = Images(js, await image_store(js), await tags_bucket(js))

        async def fetch(digest: str) -> tuple[bytes, ImageManifest | None]:
            return await images.pull(digest), await images.manifest(digest)

        self.image_cache = ImageCache(
            data / "images", quota_bytes=cfg.image_cache_mb << 20, fetch=fetch, in_use=self._images_in_use
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
            ),
            self.store,
            self.committer,
            driver,
            on_commit=self._on_commit,
            on_launch=self._follow_logs,
            secret_env=self.secrets.env_for,
            held_ports=lambda: self.tally.ports,
            images=self.image_cache,
            volumes=self.volumes,
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
        volumes_recovered = await volumes.recover()  # before machines: theirs must be mounted
        self.resumed = await self.manager.readopt()
        if volumes_recovered:
            log.info("worker %s: volumes %s", cfg.worker_id, volumes_recovered)
        for stored in self.store.machines():
            if stored.machine.state == "started":
                self.follower.follow(
                    stored.machine.id, stored.machine.app, self.manager.workdir(stored.machine.id), from_offset_now=True
                )
        await self._start_jobs()  # before the info endpoint answers: a ready worker takes jobs
        await self._subscribe()
        await self._heartbeat_once()
        self._tasks += [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self.outbox.run()),
            asyncio.create_task(self.follower.run()),
            asyncio.create_task(self._compact_loop()),
        ]
        log.info("worker %s in %s up: resumed %s, limits %s", cfg.worker_id, cfg.region, self.resumed, self.limits_mode)

    async def _volume_manager(self, js: Any, data: Path) -> VolumeManager:
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

    async def _subscribe(self) -> None:
        assert self.nc is not None
        cfg = self.config
        self._subs.append(
            await self.nc.subscribe(
                subjects.offers(cfg.region), cb=self.responder.for_subscription(self._on_offer, inline=True)
            )
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
            "machines": (subjects.worker_machines_wildcard(cfg.worker_id), self._on_machines),
            "volumes": (subjects.worker_volumes_wildcard(cfg.worker_id), self._on_volumes),
            "offer": (subjects.worker_offer(cfg.worker_id), self._on_offer),
            "info": (subjects.worker_info(cfg.worker_id), self._on_info),
            "cordon": (subjects.worker_cordon(cfg.worker_id, True), self._on_cordon),
            "uncordon": (subjects.worker_cordon(cfg.worker_id, False), self._on_cordon),
        }
        described_by = {
            "machines": [f"worker_machines_{verb}" for verb in WORKER_REQUESTS],
            "volumes": [f"worker_volumes_{verb}" for verb in WORKER_VOLUME_REQUESTS],
        }
        for name, (subject, handler) in endpoints.items():
            described = described_by.get(name, [f"worker_{name}"])
            await self._service.add_endpoint(
                EndpointConfig(
                    name=name,
                    subject=subject,
                    handler=self.responder.for_micro(handler),
                    metadata=endpoint_metadata(*described),
                )
            )
        await self.nc.flush()

    async def _start_jobs(self) -> None:
        """Background jobs (workers/jobs): this region's job desk, and pulls bounded by free slots."""
        assert self.nc is not None and self.store is not None and self.manager is not None
        cfg, store = self.config, self.store
        self.jobs = JobsService(
            self.nc,
            self.manager,
            worker_id=cfg.worker_id,
            region=cfg.region,
            slots=cfg.job_slots or cfg.cpus,
            free_cpus=lambda: cfg.cpus - store.usage().cpus,
            workers_kv=self._kv.workers,
            ack_wait=cfg.jobs_ack_wait,
        )
        # its API requests (background jobs' submit and cancel) are recorded in the audit trail, as a broker's
        self.trail = AuditTrail(self.nc)
        await self.trail.make_stream_if_open()
        self.responder = Responder(self.nc, f"worker {cfg.worker_id}", audit=RequestAudit(self.trail))
        try:
            await self.jobs.start(self.responder)
        except (FauxmadError, TimeoutError) as exc:  # a secure fleet whose operator did not prepare this region
            log.warning("worker %s: background jobs off: %s", cfg.worker_id, getattr(exc, "message", repr(exc)))
            await self.jobs.close()
            self.jobs = None

    # ------------------------------------------------------------------------------------------
    # handlers: (subject, data) -> Struct

    def snapshot(self) -> Snapshot:
        assert self.store is not None and self.manager is not None
        usage = self.store.usage()
        worker = self.store.worker()
        return Snapshot(
            worker_id=self.config.worker_id,
            region=self.config.region,
            capacity=Resources(cpus=self.config.cpus, memory_mb=self.config.memory_mb),
            used=usage.resources(),
            machines=usage.machines,
            cordoned=worker.cordoned,
            images=self._images_now(),
            load=self._load,
            inflight=self.manager.inflight,
            app_machines=self.tally.per_app,
            sandboxes=self._sandboxes,
        )

    def _images_now(self) -> frozenset[str]:
        """Images named in offers and heartbeats: names machines ran with, and the digests on disk now."""
        if self.image_cache is None:
            return self._images
        return frozenset(i for i in self._images if not is_digest(i)) | self.image_cache.cached()

    def _images_in_use(self) -> set[str]:
        assert self.store is not None
        return {
            s.machine.config.image
            for s in self.store.machines()
            if s.machine.config.image and s.machine.state in PROCESS_STATES
        }

    async def _on_offer(self, subject: str, data: bytes) -> Any:
        request = decode(OfferRequest, data)
        return answer_offer(request, self.snapshot(), self.config.backpressure)

    async def _on_machines(self, subject: str, data: bytes) -> Any:
        manager = self.manager
        assert manager is not None
        verb = subjects.parse_verb(subject)
        kind = WORKER_REQUESTS.get(verb)
        if kind is None:
            raise BadRequest(f"unknown verb {verb!r}; expected one of {', '.join(subjects.WORKER_VERBS)}")
        request = decode(kind, data, empty_ok=kind in EMPTY_OK)
        started = time.perf_counter()
        try:
            answer = getattr(manager, verb)(request)  # every verb is the manager's method of that name
            result = await answer if inspect.isawaitable(answer) else answer
        except FauxmadError as exc:
            metrics.REQUESTS.labels(verb, str(exc.code)).inc()
            raise
        metrics.REQUESTS.labels(verb, "ok").inc()
        metrics.REQUEST_SECONDS.labels(verb).observe(time.perf_counter() - started)
        if verb == "destroy":
            self.follower.unfollow(result.id)
        return result

    async def _on_volumes(self, subject: str, data: bytes) -> Any:
        """`worker.<id>.volumes.<verb>`: every verb is the volume manager's method of that name."""
        verb = subjects.parse_verb(subject)
        kind = WORKER_VOLUME_REQUESTS.get(verb)
        if kind is None:
            raise BadRequest(f"unknown verb {verb!r}; expected one of {', '.join(subjects.WORKER_VOLUME_VERBS)}")
        request = decode(kind, data, empty_ok=kind in VOLUME_EMPTY_OK)
        answer = getattr(self.volumes, verb)(request)
        return await answer if inspect.isawaitable(answer) else answer

    async def _on_info(self, subject: str, data: bytes) -> Any:
        decode(InfoRequest, data, empty_ok=True)
        return self.info()

    async def _on_cordon(self, subject: str, data: bytes) -> Any:
        assert self.committer is not None
        request = decode(CordonRequest, data, empty_ok=True)
        cordon = subjects.parse_verb(subject) == "cordon"

        def op(tx: Any) -> None:
            current = tx.worker()
            if current.cordoned != cordon or current.reason != request.reason:
                tx.put_worker(WorkerState(cordoned=cordon, reason=request.reason), "cordon" if cordon else "uncordon")

        await self.committer.submit(op)
        info = self.info()
        await self._put_heartbeat(info)
        return info

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
        )

    # ------------------------------------------------------------------------------------------
    # after commit: events, routing index, images

    def _on_commit(self, records: list[LogRecord]) -> None:
        assert self.outbox is not None
        for record in records:
            if isinstance(record, MachineRecord):
                machine = record.stored.machine
                self.tally.update(machine)
                self.outbox.committed(record)
                if record.op in ("reserve", "destroyed", "update"):
                    self._beat_soon()
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

    def _beat_soon(self) -> None:
        """Usage changed: tell the registry now rather than at the next tick (coalesced).

        Best effort, so published without waiting for JetStream's ack: at the fleet's rates this beat
        follows nearly every reserve, and the ack's round trip cost about as much as the rest of the beat.
        The tick (every `heartbeat_interval`) still waits for its ack and says when puts fail.
        """
        if self._beat_pending or self.nc is None:
            return
        self._beat_pending = True

        async def beat() -> None:
            await asyncio.sleep(0.05)
            self._beat_pending = False
            with contextlib.suppress(Exception):
                await self._heartbeat_once(acked=False)

        self._tasks.append(asyncio.create_task(beat()))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _publish_log(self, line: LogLine) -> None:
        assert self.nc is not None
        await self.nc.publish(subjects.logs(line.app, line.machine_id), encode(line))

    # ------------------------------------------------------------------------------------------
    # heartbeat and housekeeping

    async def _put_heartbeat(self, info: WorkerInfo, *, acked: bool = True) -> None:
        """Put `info` into the registry; `acked=False` only publishes it (in order with the acked puts,
        on the same connection), and not at all while disconnected: no stale beat is buffered."""
        key = subjects.worker_key(self.config.region, self.config.worker_id)
        if acked:
            await self._kv.workers.put(key, encode(info))
        elif self.nc is not None and self.nc.is_connected:
            bucket = self._kv.layout.workers_bucket(self.config.region)
            await self.nc.publish(subjects.kv_put(bucket, key), encode(info))

    async def _heartbeat_once(self, *, acked: bool = True) -> None:
        try:
            self._load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
        except OSError:
            self._load = 0.0
        await self._put_heartbeat(self.info(), acked=acked)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            try:
                await self._heartbeat_once()
            except Exception:
                log.warning("heartbeat failed", exc_info=True)

    async def _compact_loop(self) -> None:
        assert self.store is not None
        while True:
            await asyncio.sleep(self.config.compact_every)
            store = self.store
            try:
                deleted = await asyncio.to_thread(
                    store.compact,
                    keep_last=self.config.log_keep_last,
                    destroyed_retention=self.config.destroyed_retention,
                )
                if deleted:
                    log.info("compacted %d log records", deleted)
            except Exception:
                log.warning("compaction failed", exc_info=True)

    # ------------------------------------------------------------------------------------------
    async def run_forever(self) -> None:
        await self._stopped.wait()

    def request_stop(self) -> None:
        self._stopped.set()

    def _on_bus_closed(self, reason: str) -> None:
        """The connection is gone for good (not a reconnect): never stay alive but deaf."""
        if self._closing:
            return
        self.bus_lost = reason
        log.error("worker %s: %s; exiting so that the supervisor restarts it", self.config.worker_id, reason)
        self._stopped.set()

    async def _close_jobs(self) -> None:
        if self.jobs is not None:
            await self.jobs.close()

    async def close(self) -> None:
        """Stop serving, promptly: every step is bounded, and machines are left running."""
        if self.outbox is not None and self.nc is not None and self.nc.is_connected:
            await _bounded(self.outbox.flush(), 2.0)  # what the last commits changed
        self._closing = True
        await _bounded(self._close_jobs(), 3.0)
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
        if self.manager is not None:
            await _bounded(self.manager.close(), 2.0)
        if hasattr(self, "secrets"):
            await _bounded(self.secrets.close(), 1.0)
        if self.driver is not None:
            self.driver.close()  # its launcher (machines keep running)
        if self.nc is not None:
            await _bounded(self.nc.close(), 2.0)
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


async def _bounded(awaitable: Any, seconds: float) -> None:
    try:
        await asyncio.wait_for(awaitable, seconds)
    except (TimeoutError, Exception):
        log.debug("shutdown step did not finish within %ss", seconds, exc_info=True)


async def run_workers(configs: list[WorkerConfig]) -> None:
    """Run one or more workers in this process until SIGTERM/SIGINT; their machines keep running after.

    Several logical workers per process is for benchmarks of large regions: each still has its own
    connection, LMDB environment and writer thread, running the same code as a worker of its own.
    """
    import signal

    agents = [WorkerAgent(config) for config in configs]
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for agent in agents:
            agent.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        for agent in agents:
            await agent.start()
        # any agent stopping (a signal stops all; a lost bus stops one) ends the process
        await asyncio.wait(
            [asyncio.create_task(agent.run_forever()) for agent in agents], return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        await asyncio.gather(*[agent.close() for agent in agents], return_exceptions=True)
    lost = [agent.bus_lost for agent in agents if agent.bus_lost]
    if lost:
        raise Unreachable(f"worker stopped: {lost[0]}")


async def run_worker(config: WorkerConfig) -> None:
    await run_workers([config])
