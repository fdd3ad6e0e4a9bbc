"""The broker process: the machines API on `fauxmad.v1.api...`, served as NATS micro service `fauxmad-broker`.

Stateless: everything it knows is a replica (worker registry, machine index) or lives in KV
(idempotency claims), so any number run at once in queue group `brokers` and any one can die.
Per-machine verbs are validated here (a 400 never travels further) and forwarded to the owning
worker, whose answer, success or error, goes back to the caller unchanged.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.service import ServiceConfig

from bus.contract import subjects
from bus.contract.codec import clip, decode, encode
from bus.contract.deadlines import broker_wait
from bus.contract.errors import BadRequest, Conflict, FauxmadError, Forbidden, NoCapacity, NotFound, Unreachable
from bus.contract.fleet import (
    CreateRequest,
    RegionsListRequest,
    RegionSummary,
    SimulateRequest,
    WorkerInfo,
    WorkersListRequest,
)
from bus.contract.idempotency import Claim
from bus.contract.ids import new_machine_id
from bus.contract.machines import (
    ExecRequest,
    GetRequest,
    IdRequest,
    LeaseRequest,
    ListRequest,
    Machine,
    ReleaseRequest,
    StartRequest,
    index_entry,
)
from bus.contract.offers import Resources
from bus.contract.streams import AuditRecord
from bus.contract.verbs import API_REQUESTS, API_VOLUME_REQUESTS, BROKER_REQUESTS, EDGE_REQUESTS
from bus.stores.images import Images
from bus.stores.snapshots import snapshot_store, volumes_bucket
from bus.transport.audit import AuditTrail, RequestAudit, audit_to_carry, carried
from bus.transport.connection import connect
from bus.transport.fleet_layout import LayoutConflict, known_layout, told_by_env
from bus.transport.jetstream import FleetConfig, ensure_fleet_resources
from bus.transport.scatter import Scatterer
from bus.transport.service import Handler, Responder, answer, call, request
from orchestrator.broker import metrics
from orchestrator.broker.auction import Auction, AuctionConfig, Outcome, OutcomeUnknown
from orchestrator.broker.idempotency import Idempotency
from orchestrator.broker.images import ImageGate
from orchestrator.broker.readiness import (
    AUDIT,
    FLEET_BUCKETS,
    IMAGES,
    MACHINE_INDEX,
    READY_WAIT,
    REGISTRY,
    VOLUMES,
    Readiness,
)
from orchestrator.broker.releases import current_spec
from orchestrator.broker.volumes import Volumes
from orchestrator.placement.ask import Ask
from orchestrator.replicas.machines import MachineIndex
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)

VERSION = "0.1.0"

# per-machine verbs, forwarded to the owning worker: how to validate the payload (a 400 never travels further)
FORWARDED: dict[str, type[Any]] = {verb: kind for verb, kind in API_REQUESTS.items() if verb not in BROKER_REQUESTS}


def fingerprint(req: CreateRequest) -> str:
    """What an idempotency key stands for: the request, less the key and how the answer is shown."""
    same = msgspec.structs.replace(req, idempotency_key=None, explain=False, strategy=None)
    return hashlib.sha256(encode(same)).hexdigest()[:32]


REGION_PROBE_TIMEOUT = 0.5  # seconds a supercluster's region has to answer `regions.list`'s probe


class BrokerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    auction: AuctionConfig = msgspec.field(default_factory=AuctionConfig)
    name: str = ""
    region: str | None = None  # in a supercluster, the region whose cluster this broker connects to


class Broker:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.id = config.name or f"broker-{secrets.token_hex(4)}"
        self.nc: Client | None = None
        self.registry = Registry()
        self.index = MachineIndex()
        self._service: Any = None
        self._stopped = asyncio.Event()
        self._closing = False
        self.bus_lost: str | None = None  # why the bus connection ended for good, if it did
        self.failed: BaseException | None = None  # why a part can never be made (`_on_prepared`), if so
        self.readiness = Readiness(self.id)
        self._preparing: asyncio.Task[None] | None = None
        self._claims_of: dict[int, Idempotency] = {}  # by bucket: one per bucket, as its claims in progress are

    async def start(self, *, serve: bool = True) -> None:
        """Connect, answer the API subjects over NATS (with `serve`; without it the broker answers only in its own
        process, `answer`: the HTTP API embeds one that way), then make the parts that stand on JetStream in the
        background (orchestrator/broker/readiness.py): until one is made, a verb that needs it answers 503 naming
        it, and an unkeyed create is placed from the workers' offers and live heartbeats (core NATS)."""
        # no server at start: one line and exit 3, as every command (docs/reference/exit-codes.md#stopping);
        # once connected it reconnects forever, as an agent does
        self.nc = await connect(
            self.config.nats_url, f"fauxmad-{self.id}", reconnect_forever=True, on_closed=self._on_bus_closed
        )
        await self._make_live_parts()
        if serve:
            await self.registry.hear(self.nc, self._heartbeat_buckets())
            await self._serve()
        self._preparing = asyncio.create_task(self._make_stored_parts(serve))
        if not serve:
            await self._preparing  # the HTTP API opens its site once its broker has every part
            return
        self._preparing.add_done_callback(self._on_prepared)
        # every part is made within a second or so when JetStream answers: the broker says it serves then, as it
        # did when it made them first; one JetStream cannot make now does not keep it from answering meanwhile
        await asyncio.wait({self._preparing}, timeout=READY_WAIT)
        if self.failed is not None:
            raise self.failed

    async def _make_live_parts(self) -> None:
        """What needs core NATS only: the auction's scatter, the audit trail's publisher, the endpoints."""
        assert self.nc is not None
        self.scatterer = Scatterer(self.nc)
        await self.scatterer.start()
        self.auction = Auction(self.nc, self.scatterer, self.registry, self.config.auction)
        self.auction.volume_host = self._volume_host  # a create that mounts a volume goes to its worker
        self.trail = AuditTrail(self.nc)
        self._audit = RequestAudit(self.trail)
        self.responder = Responder(self.nc, self.id, audit=self._audit)
        self._endpoints = self._endpoint_table()

    def _endpoint_table(self) -> list[tuple[str, str, Handler, list[str]]]:
        endpoints: list[tuple[str, str, Handler, list[str]]] = [
            (
                "machines",
                subjects.API_MACHINES_WILDCARD,
                self._on_machines,
                [f"api_machines_{v}" for v in API_REQUESTS],
            ),
            (
                "volumes",
                subjects.API_VOLUMES_WILDCARD,
                self._on_volumes,
                [f"api_volumes_{v}" for v in API_VOLUME_REQUESTS],
            ),
            ("regions", subjects.API_REGIONS_LIST, self._on_regions, ["regions_list"]),
            ("workers", subjects.API_WORKERS_LIST, self._on_workers, ["workers_list"]),
            ("simulate", subjects.API_PLACEMENTS_SIMULATE, self._on_simulate, ["placements_simulate"]),
            ("images", subjects.API_IMAGES_PUSH_WILDCARD, self._on_images_push, ["api_images_push"]),
            ("images_rm", subjects.API_IMAGES_RM_WILDCARD, self._on_images_rm, ["api_images_rm"]),
            ("edge", subjects.API_EDGE_WILDCARD, self._on_edge, [f"api_edge_{v}" for v in EDGE_REQUESTS]),
        ]
        supercluster = self._told_supercluster()
        if supercluster is not None:
            endpoints.append(self._create_in_region_endpoint(supercluster))
        return endpoints

    def _told_supercluster(self) -> bool | None:
        """Whether `machines.create.<region>` is subscribed as a supercluster's broker of a region, when that is
        known without JetStream (None: only the fleet's layout says; the endpoint waits for it)."""
        if self.config.region is None:
            return False  # a broker of no region answers every region's, whatever the layout
        layout = known_layout(self.nc.jetstream()) if self.nc is not None else None
        if layout is not None:
            return layout.supercluster
        return True if told_by_env().regions else None

    def _create_in_region_endpoint(self, supercluster: bool) -> tuple[str, str, Handler, list[str]]:
        return (
            "machines_create_in_region",
            subjects.api_machines_create_in_wildcard(self.config.region if supercluster else None),
            self._on_create_in_region,
            ["api_machines_create_in_region"],
        )

    def _heartbeat_buckets(self) -> builtins.list[str]:
        """Where the workers this broker places on put their heartbeats, as far as known without JetStream."""
        regions = set(told_by_env().regions or ())
        if self.config.region is not None:
            regions.add(self.config.region)
        return [subjects.WORKERS_BUCKET, *(subjects.regional(subjects.WORKERS_BUCKET, r) for r in sorted(regions))]

    async def _serve(self) -> None:
        """Subscribe to the API subjects: NATS micro service `fauxmad-broker`, in the brokers' queue group."""
        assert self.nc is not None
        self._service = await add_service(
            self.nc,
            ServiceConfig(
                name=subjects.BROKER_SERVICE,
                version=VERSION,
                queue_group=subjects.BROKER_QUEUE,
                description="fauxmad broker: region auctions that fill or fail at once",
                metadata={
                    "broker_id": self.id,
                    "strategy": self.config.auction.strategy,
                    "deadline_ms": f"{self.config.auction.deadline * 1000:g}",
                },
            ),
        )
        for endpoint in self._endpoints:
            await self._add_endpoint(endpoint)
        await self.nc.flush()

    async def _add_endpoint(self, endpoint: tuple[str, str, Handler, list[str]]) -> None:
        name, subject, handler, described = endpoint
        await self.responder.add_endpoint(self._service, name, subject, handler, described)

    # ------------------------------------------------------------------------------------------
    async def _make_stored_parts(self, serve: bool) -> None:
        """Each JetStream-backed part, asked again until it is made: the fleet's buckets first (the others stand on
        them), then the rest side by side (a watch that cannot start on a leaderless region holds up no other)."""
        made = self.readiness.make
        await made(FLEET_BUCKETS, lambda: self._bind_fleet(serve), fatal=(LayoutConflict, ValueError))
        await asyncio.gather(
            made(REGISTRY, self._follow_workers),
            made(MACHINE_INDEX, self._follow_machines),
            made(VOLUMES, self._open_volumes),
            made(AUDIT, self.trail.make_stream_if_open),
            made(IMAGES, lambda: self._open_images(serve)),
        )

    def _on_prepared(self, task: asyncio.Task[None]) -> None:
        """A part that can never be made (the fleet's layout contradicts this broker's): stop; `start` or
        `run_broker` raises it, for the CLI's one line."""
        if task.cancelled() or task.exception() is None:
            return
        self.failed = task.exception()
        self._stopped.set()

    async def _bind_fleet(self, serve: bool) -> None:
        assert self.nc is not None
        kv = await ensure_fleet_resources(self.nc.jetstream(), FleetConfig(region=self.config.region))
        self.fleet_kv = kv
        self._layout = kv.layout
        self._apps = kv.apps
        if not any(name == "machines_create_in_region" for name, *_ in self._endpoints):
            endpoint = self._create_in_region_endpoint(kv.layout.supercluster)
            self._endpoints.append(endpoint)
            if serve:
                await self._add_endpoint(endpoint)

    async def _follow_workers(self) -> None:
        await self.registry.start(self.fleet_kv.workers)
        await self.registry.stop_hearing()  # the watch delivers every heartbeat from now on

    async def _follow_machines(self) -> None:
        await self.index.start(self.fleet_kv.machines)

    async def _open_volumes(self) -> None:
        assert self.nc is not None
        js = self.nc.jetstream()
        self.volumes = Volumes(self.nc, self.registry, await volumes_bucket(js), await snapshot_store(js))

    async def _open_images(self, serve: bool) -> None:
        assert self.nc is not None
        images = ImageGate(self.nc, await Images.open(self.nc.jetstream()), self.id, self._audit, self._apps)
        if serve:
            await images.start()
        self.images = images

    async def answer(self, subject: str, data: bytes) -> bytes:
        """What this broker answers to a request on `subject`, in this process: the reply's bytes, or the
        `FauxmadError` its NATS reply would carry (anything else unexpected is an `InternalError`, as there)."""
        for _, pattern, handler, _ in self._endpoints:
            if subjects.matches(pattern, subject):
                return await answer(handler, subject, data, self.id)
        raise Unreachable(f"nobody answers on {subject}")

    # ------------------------------------------------------------------------------------------
    async def _on_machines(self, subject: str, data: bytes) -> Any:
        app = subjects.check_token("app", subjects.parse_api_app(subject))
        verb = subjects.parse_verb(subject)
        if verb == "create":
            return await self.create(app, decode(CreateRequest, data))
        if verb == "list":
            return await self.list(app, decode(ListRequest, data, empty_ok=True))
        kind = FORWARDED.get(verb)
        if kind is None:
            raise BadRequest(f"unknown verb {verb!r}; expected one of {', '.join(subjects.API_VERBS)}")
        parsed: IdRequest | LeaseRequest | ReleaseRequest | ExecRequest = decode(kind, data)
        entry = await self._locate(parsed.id, app)
        timeout = broker_wait(verb, getattr(parsed, "timeout", None))
        assert self.nc is not None
        reply = await request(self.nc, subjects.worker_machines(entry.worker_id, verb), data, timeout=timeout)
        return reply.data

    async def _locate(self, machine_id: str, app: str) -> Any:
        """The index's entry of a machine; before the index runs, one it does not know yet is a 503, not a 404."""
        if self.index.get(machine_id) is None:
            await self.readiness.need(MACHINE_INDEX)
        return await self.index.locate(machine_id, app)

    async def _on_volumes(self, subject: str, data: bytes) -> Any:
        await self.readiness.need(VOLUMES)
        return await self.volumes.handle(subject, data)

    async def _on_images_push(self, subject: str, data: bytes) -> Any:
        await self.readiness.need(IMAGES)
        return await self.images.handle_push(subject, data)

    async def _on_images_rm(self, subject: str, data: bytes) -> Any:
        await self.readiness.need(IMAGES)
        return await self.images.handle_rm(subject, data)

    async def _volume_host(self, app: str, req: CreateRequest) -> tuple[str, str] | None:
        """For the auction: where the volume a create mounts is (503 before the volume stores are open)."""
        if not req.config.mounts:
            return None
        await self.readiness.need(VOLUMES)
        return await self.volumes.volume_host(app, req)

    async def _on_create_in_region(self, subject: str, data: bytes) -> Any:
        """`api.apps.<app>.machines.create.<region>`: a create sent to the brokers of its region. In a supercluster a
        broker of region R subscribes only to R's, so NATS carries the request across the gateway once and the
        auction (offers, reserve, start) runs inside R: a create from another region pays one WAN round trip, not
        the several of an auction run from the caller's region. A broker of no region answers every region's."""
        app = subjects.check_token("app", subjects.parse_api_app(subject))
        region = subjects.parse_verb(subject)
        req = decode(CreateRequest, data)
        if req.region != region:
            raise BadRequest(f"region {clip(repr(req.region))} is not the subject's region {region!r}")
        return await self.create(app, req)

    async def _on_edge(self, subject: str, data: bytes) -> Any:
        """An edge proxy's verb (`api.apps.<app>.edge.<verb>`): the machines verb of that name, for an app whose
        current release has an `[http_service]` only. Why here: a proxy's identity may publish only these
        subjects (orchestrator/security/roles.py), but nats-server cannot tell which apps the edge serves, so
        that part of the proxy role is checked by the broker that answers."""
        app = subjects.check_token("app", subjects.parse_api_app(subject))
        verb = subjects.parse_verb(subject)
        if verb not in EDGE_REQUESTS:
            raise BadRequest(f"unknown edge verb {verb!r}; expected one of {', '.join(EDGE_REQUESTS)}")
        await self.readiness.need(FLEET_BUCKETS)  # the apps' releases
        if not await self._serves_http(app):
            raise Forbidden(
                f"app {app} has no [http_service] in its current release: the edge may not {verb} its machines"
            )
        return await self._on_machines(subjects.api_machines(app, verb), data)

    async def _serves_http(self, app: str) -> bool:
        """Whether `app`'s current release has an `[http_service]` (read from KV now: edge verbs are rare)."""
        spec = await current_spec(self._apps, app)
        return spec is not None and spec.http_service is not None

    async def create(self, app: str, req: CreateRequest) -> Machine:
        req.config.require_command()
        strategy = req.strategy or self.config.auction.strategy
        # the create's audit record travels in the reserve and stays in the machine's `created` event: the
        # create's one durable write on the bus (docs/explanation/architecture.md#one-durable-write-per-create)
        audit = audit_to_carry()
        if req.idempotency_key:
            await self.readiness.need(FLEET_BUCKETS)  # the key's claim is kept there
            key = req.idempotency_key
            machine, outcome, new = await metrics.measured(
                strategy, lambda: self._place_once(app, req, key, audit), lambda placed: placed[1]
            )
            if not new:
                return machine  # the key's machine, as it is now
        else:
            machine, outcome = await metrics.measured(
                strategy, lambda: self.auction.place(app, req, audit=audit), lambda placed: placed[1]
            )
        if outcome is not None:  # reserved by this request (None: found where a claim taken over had put it)
            carried()
        self.index.remember(index_entry(machine))
        if not req.skip_launch and machine.state == "created":  # a hedge, or a key's machine reserved earlier
            assert self.nc is not None
            machine = await call(
                self.nc,
                subjects.worker_machines(machine.worker_id, "start"),
                StartRequest(id=machine.id),
                Machine,
                timeout=broker_wait("start"),
            )
        if req.explain and outcome is not None:
            machine.explain = outcome.explain()
        return machine

    def _claims(self, region: str) -> Idempotency:
        """Where a create's idempotency claim lives: the fleet's bucket, or in a supercluster its region's own
        (so a region cut off from the others keeps placing idempotently)."""
        bucket = self.fleet_kv.claims(region)
        if id(bucket) not in self._claims_of:
            self._claims_of[id(bucket)] = Idempotency(bucket, self.id)
        return self._claims_of[id(bucket)]

    async def _place_once(
        self, app: str, req: CreateRequest, key: str, audit: AuditRecord | None = None
    ) -> tuple[Machine, Outcome | None, bool]:
        """Place under an idempotency claim; the last item says whether this call placed the machine."""
        claims = self._claims(req.region)
        ticket = await claims.claim(app, key, fingerprint(req), new_machine_id())
        claim = ticket.claim
        if ticket.done:
            assert claim.machine_id is not None and claim.worker_id is not None
            return await self._get_from(claim.worker_id, claim.machine_id), None, False
        current = [claim]  # the claim as last written: `tried` grows before each reserve

        async def record(worker_id: str) -> None:
            current[0] = await claims.trying(app, key, current[0], worker_id)

        try:
            found = None
            if ticket.previous is not None:  # taken over: find out where the machine is before placing
                found, gone = await self._find(app, req, ticket.previous)
                if found is None and gone:
                    fenced = await claims.fence(app, key, ticket, gone, new_machine_id())
                    if fenced is None:  # a fenced worker came back first and settled the key on itself
                        return await self._settled_meanwhile(app, key, claims, gone, claim)
                    current[0] = claim = fenced
            assert claim.machine_id is not None
            placed: tuple[Machine, Outcome | None] = (
                (found, None)
                if found is not None
                else await self.auction.place(
                    app,
                    req,
                    claim.machine_id,
                    not_after=claim.at + claims.stale_after,
                    before_reserve=record,
                    audit=audit,
                )
            )
        except OutcomeUnknown as exc:
            await claims.uncertain(app, key, current[0], exc.workers)
            raise
        except (NoCapacity, BadRequest, Conflict, NotFound):
            await claims.refused(app, key, current[0])  # refused everywhere it was tried: nothing is held
            raise
        except BaseException:
            # anything else (a lost connection, a store timeout, a cancellation): a reserve may be in flight, so
            # the claim stays for a taker, who asks every worker it tried before placing. This broker's own
            # retry may be that taker at once: no request of its own works on the claim any more.
            await claims.release_hold(app, key)
            raise
        await claims.done(app, key, current[0], placed[0].worker_id)
        return placed[0], placed[1], True

    async def _settled_meanwhile(
        self, app: str, key: str, claims: Idempotency, gone: list[str], taken: Claim
    ) -> tuple[Machine, Outcome | None, bool]:
        """The fence lost its compare-and-set: the claim as it is now says where the key's machine is."""
        now = await claims.current(app, key)
        await claims.release_hold(app, key)
        if now is not None and now.state == "done" and now.machine_id and now.worker_id:
            return await self._get_from(now.worker_id, now.machine_id), None, False
        raise OutcomeUnknown(gone, taken.machine_id or "?")

    async def _find(self, app: str, req: CreateRequest, previous: Claim) -> tuple[Machine | None, list[str]]:
        """Which worker holds the machine of a claim taken over: the ones it named, its region's, the index's.

        Returns the machine if one answers with it, and the silent workers whose heartbeat has expired (to be
        fenced before anything is placed: bus/contract/idempotency.py); a silent live worker is a 504."""
        assert previous.machine_id is not None
        workers = set(previous.tried) | set(previous.uncertain) | self.registry.live_ids(req.region)
        entry = self.index.get(previous.machine_id)
        if entry is not None:
            workers.add(entry.worker_id)
        reserve = self.auction.reserve_request(app, req, previous.machine_id)
        found, silent, gone = await self.auction.find(sorted(workers), reserve)
        if found is None and silent:
            raise OutcomeUnknown(silent, previous.machine_id)
        return found, gone

    async def _get_from(self, worker_id: str, machine_id: str) -> Machine:
        assert self.nc is not None
        return await call(
            self.nc,
            subjects.worker_machines(worker_id, "get"),
            GetRequest(id=machine_id, events=False),
            Machine,
            timeout=5,
        )

    async def list(self, app: str, req: ListRequest) -> builtins.list[Machine]:
        if req.app is not None and req.app != app:
            raise BadRequest(f"list for app {app} cannot filter on app {req.app}")
        nc = self.nc
        assert nc is not None
        if req.worker_id is not None:  # one worker's machines of the app: its silence is the caller's error
            one = msgspec.structs.replace(req, app=app, worker_id=None)
            return await call(
                nc, subjects.worker_machines(req.worker_id, "list"), one, builtins.list[Machine], timeout=3
            )
        # the routing index is filled by the workers' outboxes, a moment after a create returns: a listing also
        # asks the workers whose heartbeat counts a machine of the app, and those this broker just placed one on
        workers = {entry.worker_id for entry in self.index.by_app(app)}
        workers |= {info.worker_id for info in self.registry.workers() if info.app_machines.get(app)}
        workers |= self.auction.picks.workers_of(app)
        query = msgspec.structs.replace(req, app=app)

        async def from_worker(worker_id: str) -> builtins.list[Machine]:
            try:
                return await call(
                    nc,
                    subjects.worker_machines(worker_id, "list"),
                    query,
                    builtins.list[Machine],
                    timeout=3,
                )
            except FauxmadError as exc:
                log.warning("list: worker %s did not answer: %s", worker_id, exc.message)
                return []

        results = await asyncio.gather(*[from_worker(w) for w in sorted(workers)])
        machines = [m for group in results for m in group]
        machines.sort(key=lambda m: (m.region, m.created_at, m.id))
        return machines

    async def _on_regions(self, subject: str, data: bytes) -> Any:
        decode(RegionsListRequest, data, empty_ok=True)
        await self.readiness.need(FLEET_BUCKETS)  # the layout: in a supercluster, every region is listed
        summaries: dict[str, RegionSummary] = {}
        for info in self.registry.workers():
            s = summaries.setdefault(
                info.region,
                RegionSummary(
                    region=info.region, workers=0, cordoned=0, capacity=Resources(), used=Resources(), machines=0
                ),
            )
            s.workers += 1
            s.cordoned += int(info.cordoned)
            s.capacity.cpus += info.capacity.cpus
            s.capacity.memory_mb += info.capacity.memory_mb
            s.used.cpus += info.used.cpus
            s.used.memory_mb += info.used.memory_mb
            s.machines += info.machines
        if self._layout.supercluster:
            await self._mark_unreachable(summaries)
        return [summaries[r] for r in sorted(summaries)]

    async def _mark_unreachable(self, summaries: dict[str, RegionSummary]) -> None:
        """Every region of a supercluster, each said reachable or not: whether its heartbeats stream answers."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=REGION_PROBE_TIMEOUT)

        async def answers(region: str) -> bool:
            try:
                await js.stream_info(f"KV_{self._layout.workers_bucket(region)}")
                return True
            except Exception:
                return False

        regions = list(self._layout.regions)
        for region, ok in zip(regions, await asyncio.gather(*(answers(r) for r in regions)), strict=True):
            s = summaries.setdefault(
                region,
                RegionSummary(region=region, workers=0, cordoned=0, capacity=Resources(), used=Resources(), machines=0),
            )
            s.reachable = ok

    async def _on_workers(self, subject: str, data: bytes) -> builtins.list[WorkerInfo]:
        req = decode(WorkersListRequest, data, empty_ok=True)
        return self.registry.workers(req.region)

    async def _on_simulate(self, subject: str, data: bytes) -> Any:
        req = decode(SimulateRequest, data)
        outcome = await self.auction.rank(Ask.for_simulate(req), req.strategy or self.config.auction.strategy)
        if outcome.ranking.candidates:
            outcome.winner = outcome.ranking.candidates[0].worker_id
        return outcome.explain()

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
        log.error("broker %s: %s; exiting so that the supervisor restarts it", self.id, reason)
        self._stopped.set()

    async def close(self) -> None:
        self._closing = True
        if self._preparing is not None:
            self._preparing.cancel()
            with contextlib.suppress(BaseException):
                await self._preparing
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        if hasattr(self, "images"):
            await self.images.close()
        if hasattr(self, "responder"):
            await self.responder.drain(2.0)
            await self.trail.drain()
        await self.registry.close()
        await self.index.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 2.0)


async def run_broker(config: BrokerConfig, on_ready: Callable[[Broker], None] = lambda broker: None) -> None:
    """Run a broker until cancelled (SIGTERM/SIGINT: the CLI's `serve` cancels it) or a lost bus (`Unreachable`);
    `on_ready` runs once it serves (the CLI says so there)."""
    broker = Broker(config)
    try:
        await broker.start()
        on_ready(broker)
        await broker.run_forever()
    finally:
        await broker.close()
    if broker.failed is not None:
        raise broker.failed
    if broker.bus_lost:
        raise Unreachable(f"broker stopped: {broker.bus_lost}")
