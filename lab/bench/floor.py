"""The placement floor: fauxmad's create protocol with no fauxmad code, on the same nats-server.

`FloorResponders` starts N plain nats-py processes per region (`floor_responder.py`, run by path) and a
file-backed JetStream stream for their reserves; `measure_floor_creates` is the client: per create it
scatters an offer request to the region's responders, gathers until all have answered or the broker's
deadline (50 ms, `FleetSpec.deadline_ms`) passes, picks the most free (less what it picked itself and
has not heard back about: a broker's discount), and reserves on the pick with a request. Plain nats-py
throughout, so the numbers are what the bus, one fsync and one JetStream ack cost: what fauxmad's
create is measured against (`lab.bench.floor_run`).
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

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StorageType, StreamConfig

from lab.bench import BenchError
from lab.bench.cpu import Meter
from lab.bench.placement import MAX_CLIENTS, CreateRun, metered

SCRIPT = Path(__file__).with_name("floor_responder.py")
STREAM = "FAUXMAD_FLOOR"
STREAM_SUBJECTS = "floor.v1.events.>"
RESERVE_TIMEOUT = 2.0  # as the broker's AuctionConfig.reserve_timeout


def offers_subject(region: str) -> str:
    return f"floor.v1.offers.{region}"


def reserve_subject(worker_id: str) -> str:
    return f"floor.v1.worker.{worker_id}.machines.reserve"


class FloorResponders:
    """`with FloorResponders(url, regions, n) as floor:` n responder processes per region, ready.

    Each keeps its LMDB environment in `root/<worker id>` (a temporary directory unless `root` is
    given, which is then kept, so a test can read what the responders wrote)."""

    def __init__(self, url: str, regions: list[str], per_region: int, *, root: Path | None = None) -> None:
        self.url = url
        self.regions = regions
        self.per_region = per_region
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="fauxmad-floor-"))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def worker_ids(self) -> dict[str, list[str]]:
        return {r: [f"floor-{r}-{i + 1}" for i in range(self.per_region)] for r in self.regions}

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs.values()]

    def __enter__(self) -> FloorResponders:
        try:
            asyncio.run(self._make_stream())
            for region, ids in self.worker_ids.items():
                for worker_id in ids:
                    path = self.root / worker_id
                    path.mkdir(parents=True, exist_ok=True)
                    subject = f"floor.v1.events.{worker_id}"
                    self.procs[worker_id] = subprocess.Popen(
                        [sys.executable, str(SCRIPT), self.url, region, worker_id, str(path), subject],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                    )
            for worker_id, proc in self.procs.items():
                self._wait_ready(worker_id, proc)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self, worker_id: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout) and proc.stdout.readline().strip() == b"ready":
                return
        raise BenchError(f"floor responder {worker_id} did not start: {self._last_error(proc)}")

    @staticmethod
    def _last_error(proc: subprocess.Popen[bytes]) -> str:
        if proc.poll() is None:
            return "no answer within the timeout"
        assert proc.stderr is not None
        lines = proc.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit code {proc.returncode}"

    async def _make_stream(self) -> None:
        nc = await nats.connect(self.url.split(","), name="fauxmad-floor-setup")
        try:
            config = StreamConfig(name=STREAM, subjects=[STREAM_SUBJECTS], storage=StorageType.FILE)
            await nc.jetstream().add_stream(config)
        finally:
            await nc.close()

    async def stream_messages(self) -> int:
        """How many reserves the floor's stream holds (each one the responders published and had acked)."""
        nc = await nats.connect(self.url.split(","), name="fauxmad-floor-check")
        try:
            info = await nc.jetstream().stream_info(STREAM)
            return int(info.state.messages)
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
        self.procs.clear()
        with contextlib.suppress(Exception):
            asyncio.run(self._drop_stream())
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    async def _drop_stream(self) -> None:
        nc = await nats.connect(self.url.split(","), name="fauxmad-floor-setup", allow_reconnect=False)
        try:
            await nc.jetstream().delete_stream(STREAM)
        finally:
            await nc.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Gatherer:
    """One wildcard inbox per connection; a fresh reply subject per scatter (as fauxmad's Scatterer)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.waiting: dict[str, tuple[list[dict[str, object]], asyncio.Event, int]] = {}
        self.counter = 0

    async def start(self) -> None:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        entry = self.waiting.get(msg.subject)
        if entry is None:
            return
        replies, done, expected = entry
        replies.append(json.loads(msg.data))
        if len(replies) >= expected:
            done.set()

    async def scatter(self, subject: str, payload: bytes, expected: int, deadline: float) -> list[dict[str, object]]:
        self.counter += 1
        reply = f"{self.prefix}.{self.counter}"
        replies: list[dict[str, object]] = []
        done = asyncio.Event()
        self.waiting[reply] = (replies, done, expected)
        try:
            await self.nc.publish(subject, payload, reply=reply)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=deadline)
        finally:
            del self.waiting[reply]
        return list(replies)


def pick(offers: list[dict[str, object]], pending: dict[str, int], rng: random.Random) -> str | None:
    """The most free worker, less what this client has picked there and not heard back about; ties at random."""
    best: list[str] = []
    top = None
    for offer in offers:
        worker_id = str(offer["worker_id"])
        free = int(str(offer["free_cpus"])) - pending.get(worker_id, 0)
        if top is None or free > top:
            best, top = [worker_id], free
        elif free == top:
            best.append(worker_id)
    return rng.choice(best) if best else None


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
) -> FloorRun:
    """`count` creates of the floor, `concurrency` in flight, round robin over `regions` (as fauxmad's)."""
    per = min(concurrency, MAX_CLIENTS)
    conns = [await nats.connect(url.split(","), name="fauxmad-floor-client") for _ in range(per)]
    gatherers = [_Gatherer(nc) for nc in conns]
    for gatherer in gatherers:
        await gatherer.start()
    run = FloorRun(samples=[], refused=0, errors=0, wall_s=0.0, acknowledged=[])
    pending: dict[str, int] = {}
    rng = random.Random(7)
    todo = iter(range(count))

    async def one(gatherer: _Gatherer, region: str) -> bool:
        ask = json.dumps({"app": "bench", "region": region, "cpus": 1, "memory_mb": 1}).encode()
        offers = await gatherer.scatter(offers_subject(region), ask, per_region, deadline)
        chosen = pick(offers, pending, rng)
        if chosen is None:
            run.refused += 1
            run.first_refusal = run.first_refusal or f"no offer from {region} within {deadline * 1000:g} ms"
            return False
        machine_id = uuid.uuid4().hex[:14]
        pending[chosen] = pending.get(chosen, 0) + 1
        try:
            body = json.dumps({"id": machine_id, "app": "bench", "cpus": 1, "memory_mb": 1}).encode()
            reply = await gatherer.nc.request(reserve_subject(chosen), body, timeout=RESERVE_TIMEOUT)
        finally:
            pending[chosen] -= 1
        if json.loads(reply.data)["id"] != machine_id:
            raise BenchError(f"floor responder {chosen} answered for another machine")
        run.acknowledged.append(machine_id)
        return True

    async def creator(index: int) -> None:
        for i in todo:
            began = time.perf_counter()
            try:
                if await one(gatherers[index % per], regions[i % len(regions)]):
                    run.samples.append(time.perf_counter() - began)
            except Exception as exc:
                run.errors += 1
                run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"

    try:
        run.wall_s = await metered([creator(i) for i in range(concurrency)], meters)
    finally:
        for nc in conns:
            await nc.close()
    return run
