"""A process of logical workers (`fauxmad worker --count`, the benchmarks' simulated fleet, issue 44): each
worker answers the auction, its own verbs and beats its own key, as a worker of its own, while the process
holds one job puller, one NATS connection and one watch of the secrets for all of them. Real nats-server and a real worker process."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import nats

from bus.stores.kv_keys import kv_keys
from tests.helpers import RawClient, WorkerProcess, arun, fauxmad, until

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
                # every logical worker answers the auction (one offer each) and beats its own key
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
                # (CI47: NoKeysError while all fifty had offered and beaten), see bus.stores.kv_keys
                keys = await kv_keys(kv, f"{region}.>")
                assert sorted(keys) == [f"{region}.{one}" for one in workers.ids()]
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
