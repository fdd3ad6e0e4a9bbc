"""A process of logical workers (`fauxmad worker --count`, the benchmarks' simulated fleet, issue 44): each
worker answers the auction and its own verbs, as a worker of its own, while the process holds one job puller, one
NATS connection, one watch of the secrets and one heartbeat key for all of them (`bus.contract.beats`: every reader
still sees a heartbeat per worker). Real nats-server and real worker and broker processes."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import nats

from bus.contract import subjects
from bus.stores.kv_keys import kv_keys
from bus.transport.jetstream import ensure_fleet_resources
from orchestrator.replicas.workers import Registry
from tests.helpers import RawClient, WorkerProcess, arun, fauxmad, spawn_broker, until

COUNT = 50


class LogicalWorkers(WorkerProcess):
    """`fauxmad worker --count COUNT`: ready once its last logical worker answers `info`."""

    def ids(self) -> list[str]:
        return [f"{self.worker_id}-{i:04d}" for i in range(COUNT)]

    def wait_ready(self, timeout: float) -> None:
        last = self.worker_id
        self.worker_id = self.ids()[-1]
        try:
            super().wait_ready(timeout)
        finally:
            self.worker_id = last


def connections_to(pid: int, port: int) -> int:
    """TCP connections process `pid` holds to `port` (its sockets, looked up in the kernel's table)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:  # 01: established
                found += 1
    return found


def test_one_puller_and_one_connection_for_fifty_logical_workers(
    nats_url: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    region, base, app = unique("r"), unique("w"), unique("a")
    workers = LogicalWorkers(nats_url, region, base, tmp_path / base, cpus=2, extra=["--count", str(COUNT)])

    async def secrets_watches() -> int:  # the ordered consumers on the fleet's secrets (each worker process's watch)
        nc = await nats.connect(nats_url)
        try:
            return len(await nc.jetstream().consumers_info("KV_fauxmad_secrets"))
        except nats.js.errors.NotFoundError:  # no worker has made the bucket yet
            return 0
        finally:
            await nc.close()

    try:
        watches_before = arun(secrets_watches())
        workers.start(timeout=60)
        assert workers.proc is not None
        pid = workers.proc.pid

        async def main() -> None:
            nc = await nats.connect(nats_url)
            try:
                # every logical worker answers the auction (one offer each)
                inbox = nc.new_inbox()
                offers: list[dict[str, object]] = []

                async def on_offer(msg):  # type: ignore[no-untyped-def]
                    offers.append(json.loads(msg.data))

                await nc.subscribe(inbox, cb=on_offer)
                request = {"app": app, "region": region, "guest": {"cpus": 1, "memory_mb": 256}}
                await nc.publish(f"fauxmad.v1.offers.{region}", json.dumps(request).encode(), reply=inbox)

                async def all_offered() -> bool:
                    return len(offers) >= COUNT

                await until(all_offered, f"{COUNT} offers", 10.0)
                assert sorted(str(offer["worker_id"]) for offer in offers) == workers.ids()
                kv = await nc.jetstream().key_value("fauxmad_workers")
                # from the stream's subjects: nats-py's keys() ends at a marker that can come before the values
                # (CI47: NoKeysError while all fifty had offered and beaten), see bus.stores.kv_keys; the fifty beat
                # under one key, their group's (the next test)
                keys = await kv_keys(kv, f"{region}.>")
                assert keys == [subjects.group_key(region, workers.ids()[0])]
                # a verb reaches the logical worker it names, and its reserve is that worker's alone
                chosen = workers.ids()[31]
                machine = await RawClient(nc, chosen).ok(
                    "reserve", {"app": app, "region": region, "name": "m", "config": {"cmd": ["true"]}}
                )
                assert machine["worker_id"] == chosen and machine["state"] == "created"
                for one in (chosen, workers.ids()[30]):
                    info = json.loads((await nc.request(f"fauxmad.v1.worker.{one}.info", b"")).data)
                    assert info["pid"] == pid and info["machines"] == (1 if one == chosen else 0)
                # one job puller for the process: the queue's consumer holds one pull request, not one per worker
                js = nc.jetstream()
                for _ in range(10):
                    waiting = (await js.consumer_info(f"FAUXMAD_JOBS_{region}", "workers")).num_waiting
                    assert waiting <= 1, f"{waiting} pull requests open on the jobs queue"
                    await asyncio.sleep(0.1)
            finally:
                await nc.close()

        arun(main())
        # one connection to the server for the whole process, and one watch of the fleet's secrets
        assert connections_to(pid, urlparse(nats_url).port or 4222) == 1
        assert arun(secrets_watches()) - watches_before <= 1
        # and its jobs run: taken by its first logical worker (the process's one puller)
        done = fauxmad("job", "submit", "-a", app, "-r", region, "--wait", "--json", "--", "true", url=nats_url)
        assert done.returncode == 0, done.stderr
        (job,) = json.loads(done.stdout)
        assert job["state"] == "succeeded" and job["worker_id"] == workers.ids()[0], job
    finally:
        workers.terminate()
        workers.cleanup()


def test_fifty_logical_workers_beat_in_one_put_and_every_reader_loses_them_all_to_a_kill9(
    nats_url: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """Issue 44: a process of logical workers puts one key an interval (its beat group), not one a worker; every
    reader still sees each worker, alive (a registry of this test, a broker's, through `fauxmad workers`) and
    reserving, and sees all of them gone when the process is killed -9 (its group's key expires). Beside it a
    worker of its own, as in a real fleet, beats its own key as before (and keeps the bucket from falling silent:
    a registry takes a whole bucket's silence for the store's, `orchestrator.replicas.workers`)."""
    region, base, app = unique("r"), unique("w"), unique("a")
    workers = LogicalWorkers(nats_url, region, base, tmp_path / base, cpus=2, extra=["--count", str(COUNT)])
    alone = WorkerProcess(nats_url, unique("r"), unique("w"), tmp_path / "alone", cpus=1)
    broker = spawn_broker(nats_url, unique("b"), tmp_path / "broker.log")

    def listed() -> list[str]:
        """The region's workers `fauxmad workers` lists (all of them: a region without any is a usage error)."""
        done = fauxmad("workers", "--json", url=nats_url)
        assert done.returncode == 0, done.stderr
        return sorted(str(one["worker_id"]) for one in json.loads(done.stdout) if one["region"] == region)

    async def listed_as(expected: list[str]) -> None:
        """`fauxmad workers` (a broker's registry) lists `expected`, within 20 s (a broker may still be starting,
        or waiting for an expiry)."""
        found: list[str] = []
        for _ in range(40):
            found = await asyncio.to_thread(listed)
            if found == expected:
                return
            await asyncio.sleep(0.5)
        raise AssertionError(f"fauxmad workers listed {found[:3]}... ({len(found)}), not {len(expected)} workers")

    try:
        alone.start()
        workers.start(timeout=60)

        async def main() -> None:
            nc = await nats.connect(nats_url)
            registry = Registry()
            try:
                puts: list[str] = []
                its_own: list[str] = []

                async def on_put(msg):  # type: ignore[no-untyped-def]
                    puts.append(msg.subject)

                async def on_its_own(msg):  # type: ignore[no-untyped-def]
                    its_own.append(msg.subject)

                await nc.subscribe(subjects.kv_put(subjects.WORKERS_BUCKET, f"{region}.>"), cb=on_put)
                await nc.subscribe(subjects.kv_put(subjects.WORKERS_BUCKET, f"{alone.region}.>"), cb=on_its_own)
                await registry.start((await ensure_fleet_resources(nc.jetstream())).workers)

                async def all_live() -> bool:
                    return [info.worker_id for info in registry.workers(region)] == workers.ids()

                await until(all_live, f"the registry's {COUNT} live workers", 10.0)
                # a few intervals (1 s) of an idle process's beats: its group's key alone, not fifty keys
                puts.clear()
                await asyncio.sleep(3.5)
                group = subjects.group_key(region, workers.ids()[0])
                keys = sorted(set(puts))
                assert keys == [subjects.kv_put(subjects.WORKERS_BUCKET, group)], f"{len(puts)} puts, {len(keys)} keys"
                assert len(puts) < COUNT, f"{len(puts)} puts in 3.5 s"
                own_key = subjects.worker_key(alone.region, alone.worker_id)
                assert its_own and set(its_own) == {subjects.kv_put(subjects.WORKERS_BUCKET, own_key)}
                # a worker the registry samples (as p2c does) reserves, and its heartbeat says so soon, through its
                # group's key, the others' unchanged
                (chosen,) = registry.sample(region, 1, random.Random(7)) or []
                machine = await RawClient(nc, chosen).ok(
                    "reserve", {"app": app, "region": region, "name": "m", "config": {"cmd": ["true"]}}
                )
                assert machine["worker_id"] == chosen

                async def counted() -> bool:
                    info = registry.in_region(region, chosen)
                    return info is not None and info.machines == 1 and info.app_machines.get(app) == 1

                await until(counted, "the reserve in the registry", 10.0)
                others = [info.machines for info in registry.workers(region) if info.worker_id != chosen]
                assert others == [0] * (COUNT - 1)
                await listed_as(workers.ids())  # a broker's registry, through the CLI

                workers.kill9()

                # each removed by the expiry marker of their group's key (`in_region` keeps a worker whose
                # heartbeat is only late: it forgets one only when its key is deleted or expires)
                async def removed() -> bool:
                    return all(registry.in_region(region, one) is None for one in workers.ids())

                await until(removed, "every logical worker removed from the registry", 20.0)
                await listed_as([])
                assert registry.is_live(alone.worker_id)
            finally:
                await registry.close()
                await nc.close()

        arun(main())
    finally:
        workers.kill9()
        workers.cleanup()
        alone.terminate()
        alone.cleanup()
        broker.terminate()
        broker.wait(10)
