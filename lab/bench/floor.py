"""The placement floor: fauxmad's create protocol with no fauxmad code, on the same nats-server.

`FloorResponders` starts N plain nats-py processes per region (`floor_responder.py`, run by path) and
file-backed JetStream streams for their reserves; `measure_floor_creates` is the client. On the plain floor
(`FLOOR`) the client runs the auction itself: per create it scatters an offer request to the region's
responders, gathers until all have answered or the broker's deadline (50 ms, `FleetSpec.deadline_ms`)
passes, picks the most free (less what it picked itself and has not heard back about: a broker's
discount), and reserves on the pick with a request. Plain nats-py throughout, so the numbers are what the
bus, one fsync and one JetStream ack cost: what fauxmad's create is measured against (`lab.bench.floor_run`).

The plain floor leaves out parts of a create that fauxmad's contract asks of any implementation. The
contract's floors (`CONTRACT`, `CONTRACT_AUDITED`) add them, still in plain nats-py, so a run shows what
the contract costs apart from what fauxmad's code costs:
- `CONTRACT`: the client asks a broker (`floor_broker.py`, one per region), which runs the auction (the
  DESIGN's broker: clients and other services send a create to the brokers' subject), and the responder
  stores the machine's routing index entry (unsynced, as fauxmad's bucket on one server) before its reply,
  so that any broker finds the machine from the reply on. The create's audit record rides in the reserve
  and the event, which is the least the contract allows (every mutating request audited with its signer).
- `CONTRACT_AUDITED`: also what fauxmad chose beyond that: the record sent to an audit stream of its own
  after the reply (fsync'd, kept 90 days), and the broker following the routing index (a replica in every
  broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec
import nats
from nats.js.api import PersistMode, StorageType, StreamConfig

from lab.bench import BenchError
from lab.bench.cpu import Meter
from lab.bench.floor_auction import FloorSubjects, Gatherer, pick
from lab.bench.placement import MAX_CLIENTS, CreateRun, metered

SCRIPT = Path(__file__).with_name("floor_responder.py")
RESERVE_TIMEOUT = 2.0  # as the broker's AuctionConfig.reserve_timeout
BROKER_DEADLINE = 0.05  # a floor broker's gather deadline unless told: a dev fleet's broker's (`FleetSpec.deadline_ms`)
CREATE_TIMEOUT = 5.0  # a create through the floor's broker: its gather and its reserve, with room


class Variant(msgspec.Struct, frozen=True, kw_only=True):
    """One floor: its name in reports, its subjects' namespace and stream names, and which parts it has."""

    name: str
    namespace: str
    stream: str  # the events stream; the index and audit streams are named after it
    broker: bool = False  # creates go through a broker process, not the client's own auction
    index: bool = False  # the routing index entry stored before the reserve's reply
    audit: bool = False  # the audit record to a stream of its own after the reply; the broker follows the index

    @property
    def subjects(self) -> FloorSubjects:
        return FloorSubjects(self.namespace)


FLOOR = Variant(name="floor", namespace="floor.v1", stream="FAUXMAD_FLOOR")
CONTRACT = Variant(name="contract", namespace="floor.v1c", stream="FAUXMAD_FLOOR_C", broker=True, index=True)
CONTRACT_AUDITED = Variant(
    name="contract+audit", namespace="floor.v1a", stream="FAUXMAD_FLOOR_A", broker=True, index=True, audit=True
)


class FloorResponders:
    """`with FloorResponders(url, regions, n) as floor:` n responder processes per region, ready (and a broker
    per region for a variant that has one).

    Each keeps its LMDB environment in `root/<worker id>` (a temporary directory unless `root` is
    given, which is then kept, so a test can read what the responders wrote)."""

    def __init__(
        self,
        url: str,
        regions: list[str],
        per_region: int,
        *,
        root: Path | None = None,
        variant: Variant = FLOOR,
        deadline: float = BROKER_DEADLINE,
    ) -> None:
        """`deadline`: the gather deadline of the variant's broker, if it has one (seconds)."""
        self.url = url
        self.deadline = deadline
        self.regions = regions
        self.per_region = per_region
        self.variant = variant
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="fauxmad-floor-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.held: dict[str, int] = {}  # what the streams held once the responders had stopped (`close`)

    @property
    def worker_ids(self) -> dict[str, list[str]]:
        return {r: [f"floor-{r}-{i + 1}" for i in range(self.per_region)] for r in self.regions}

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs.values()]

    def __enter__(self) -> FloorResponders:
        subjects = self.variant.subjects
        try:
            asyncio.run(self._make_streams())
            for region, ids in self.worker_ids.items():
                for worker_id in ids:
                    path = self.root / worker_id
                    path.mkdir(parents=True, exist_ok=True)
                    parts = ["--offers", subjects.offers(region), "--reserve", subjects.reserve(worker_id)]
                    parts += ["--event", subjects.events(worker_id)]
                    if self.variant.index:
                        parts += ["--index", subjects.index]
                    if self.variant.audit:
                        parts += ["--audit", subjects.audit(worker_id)]
                    self._spawn(worker_id, [str(SCRIPT), self.url, region, worker_id, str(path), *parts])
                if self.variant.broker:
                    follow = ["--follow"] if self.variant.audit else []
                    deadline = str(self.deadline)
                    broker = ["-m", "lab.bench.floor_broker", self.url, self.variant.namespace, region]
                    self._spawn(f"broker-{region}", [*broker, str(len(ids)), deadline, *follow])
            for name, proc in self.procs.items():
                self._wait_ready(name, proc)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        self.procs[name] = subprocess.Popen(
            [sys.executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2],  # `-m lab.bench.floor_broker` from the project's root
        )

    def _wait_ready(self, name: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout) and proc.stdout.readline().strip() == b"ready":
                return
        raise BenchError(f"floor {self.variant.name}'s {name} did not start: {self._last_error(proc)}")

    @staticmethod
    def _last_error(proc: subprocess.Popen[bytes]) -> str:
        if proc.poll() is None:
            return "no answer within the timeout"
        assert proc.stderr is not None
        lines = proc.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit code {proc.returncode}"

    def _streams(self) -> list[StreamConfig]:
        """The events stream; the routing index (one entry a machine, unsynced as fauxmad's on one server); the
        audit stream (fsync'd, as every stream of a fleet's nats-server)."""
        namespace, stream = self.variant.namespace, self.variant.stream
        configs = [StreamConfig(name=stream, subjects=[f"{namespace}.events.>"], storage=StorageType.FILE)]
        if self.variant.index:
            configs.append(
                StreamConfig(
                    name=f"{stream}_INDEX",
                    subjects=[f"{namespace}.index.>"],
                    storage=StorageType.FILE,
                    max_msgs_per_subject=1,
                    persist_mode=PersistMode.ASYNC,
                )
            )
        if self.variant.audit:
            configs.append(
                StreamConfig(name=f"{stream}_AUDIT", subjects=[f"{namespace}.audit.>"], storage=StorageType.FILE)
            )
        return configs

    async def _make_streams(self) -> None:
        nc = await nats.connect(self.url.split(","), name="fauxmad-floor-setup")
        try:
            for config in self._streams():
                await nc.jetstream().add_stream(config)
        finally:
            await nc.close()

    async def stream_messages(self) -> dict[str, int]:
        """How many messages each of the floor's streams holds, by stream name (the events stream: one per
        acknowledged reserve; the index: one per machine; the audit stream: one per reserve, sent after it)."""
        nc = await nats.connect(self.url.split(","), name="fauxmad-floor-check")
        try:
            held: dict[str, int] = {}
            for config in self._streams():
                name = str(config.name)
                held[name] = int((await nc.jetstream().stream_info(name)).state.messages)
            return held
        finally:
            await nc.close()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        if self.procs:  # every responder has sent what it had to (an audit record goes after the reply)
            with contextlib.suppress(Exception):
                self.held = asyncio.run(self.stream_messages())
        self.procs.clear()
        with contextlib.suppress(Exception):
            asyncio.run(self._drop_streams())
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    async def _drop_streams(self) -> None:
        nc = await nats.connect(self.url.split(","), name="fauxmad-floor-setup", allow_reconnect=False)
        try:
            for config in self._streams():
                with contextlib.suppress(Exception):
                    await nc.jetstream().delete_stream(str(config.name))
        finally:
            await nc.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


class FloorRun(CreateRun):
    """A floor loop's `CreateRun`, with the machine ids the responders acknowledged."""

    acknowledged: list[str] = []


async def measure_floor_creates(
    url: str,
    regions: list[str],
    per_region: int,
    *,
    count: int,
    concurrency: int,
    deadline: float,
    meters: Sequence[Meter] = (),
    variant: Variant = FLOOR,
) -> FloorRun:
    """`count` creates of the floor, `concurrency` in flight, round robin over `regions` (as fauxmad's): the
    client's own auction, or a request to the variant's broker."""
    subjects = variant.subjects
    per = min(concurrency, MAX_CLIENTS)
    conns = [await nats.connect(url.split(","), name="fauxmad-floor-client") for _ in range(per)]
    gatherers = [Gatherer(nc) for nc in conns]
    for gatherer in gatherers:
        await gatherer.start()
    run = FloorRun(samples=[], refused=0, errors=0, wall_s=0.0, acknowledged=[])
    pending: dict[str, int] = {}
    rng = random.Random(7)
    todo = iter(range(count))

    async def auction(gatherer: Gatherer, region: str) -> str | None:
        """The client's own auction: the reserved machine's id, or None (refused)."""
        ask = json.dumps({"app": "bench", "region": region, "cpus": 1, "memory_mb": 1}).encode()
        offers = await gatherer.scatter(subjects.offers(region), ask, per_region, deadline)
        chosen = pick(offers, pending, rng)
        if chosen is None:
            run.refused += 1
            run.first_refusal = run.first_refusal or f"no offer from {region} within {deadline * 1000:g} ms"
            return None
        machine_id = uuid.uuid4().hex[:14]
        pending[chosen] = pending.get(chosen, 0) + 1
        try:
            body = json.dumps({"id": machine_id, "app": "bench", "cpus": 1, "memory_mb": 1}).encode()
            reply = await gatherer.nc.request(subjects.reserve(chosen), body, timeout=RESERVE_TIMEOUT)
        finally:
            pending[chosen] -= 1
        if json.loads(reply.data)["id"] != machine_id:
            raise BenchError(f"floor responder {chosen} answered for another machine")
        return machine_id

    async def brokered(gatherer: Gatherer, region: str) -> str | None:
        """A create through the variant's broker: the machine's id, or None (refused)."""
        ask = json.dumps({"app": "bench", "region": region}).encode()
        reply = await gatherer.nc.request(subjects.create(region), ask, timeout=CREATE_TIMEOUT)
        answer = json.loads(reply.data)
        if "error" in answer:
            run.refused += 1
            run.first_refusal = run.first_refusal or f"{region}: {answer['error']}"
            return None
        return str(answer["id"])

    one = brokered if variant.broker else auction

    async def creator(index: int) -> None:
        for i in todo:
            began = time.perf_counter()
            try:
                machine_id = await one(gatherers[index % per], regions[i % len(regions)])
                if machine_id is not None:
                    run.samples.append(time.perf_counter() - began)
                    run.acknowledged.append(machine_id)
            except Exception as exc:
                run.errors += 1
                run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"

    try:
        run.wall_s = await metered([creator(i) for i in range(concurrency)], meters)
    finally:
        for nc in conns:
            await nc.close()
    return run
