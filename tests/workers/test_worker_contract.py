"""The worker driven with raw NATS JSON, as another service would: real nats-server, real processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import nats

from tests.helpers import RawClient, WorkerProcess, arun, until

SLEEPER = ["sh", "-c", "echo ready on $PORT as $FAUXMAD_MACHINE_ID; echo oops >&2; exec sleep 60"]


def test_offer_reserve_start_stop_destroy_lifecycle(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory(cpus=2, memory_mb=1024)

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        events: list[dict[str, object]] = []
        logs: list[dict[str, object]] = []

        async def on_event(msg):  # type: ignore[no-untyped-def]
            events.append(json.loads(msg.data))

        async def on_log(msg):  # type: ignore[no-untyped-def]
            logs.append(json.loads(msg.data))

        await nc.subscribe(f"fauxmad.v1.events.{worker.region}.{worker.worker_id}.>", cb=on_event)
        await nc.subscribe("fauxmad.v1.logs.shop.>", cb=on_log)

        # the auction: a plain subscription, one answer per worker
        inbox = nc.new_inbox()
        offers: list[dict[str, object]] = []

        async def on_offer(msg):  # type: ignore[no-untyped-def]
            offers.append(json.loads(msg.data))

        await nc.subscribe(inbox, cb=on_offer)
        request = {"app": "shop", "region": worker.region, "guest": {"cpus": 1, "memory_mb": 256}}
        await nc.publish(f"fauxmad.v1.offers.{worker.region}", json.dumps(request).encode(), reply=inbox)
        # a window for a second offer to arrive if one were sent: exactly one, so the time is the test
        await asyncio.sleep(0.3)
        assert offers == [offers[0]] and offers[0]["type"] == "offer"
        assert offers[0]["free"] == {"cpus": 2, "memory_mb": 1024}

        machine = await raw.ok(
            "reserve",
            {
                "app": "shop",
                "region": worker.region,
                "name": "web-1",
                "config": {"cmd": SLEEPER, "env": {"GREETING": "hola"}},
            },
        )
        assert machine["state"] == "created" and len(machine["id"]) == 14
        for field in (
            "id",
            "name",
            "app",
            "region",
            "worker_id",
            "state",
            "config",
            "instance_id",
            "created_at",
            "updated_at",
        ):
            assert field in machine
        mid = machine["id"]
        started = await raw.ok("start", {"id": mid})
        assert started["state"] == "started" and started["port"] > 0
        info = json.loads((await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.info", b"")).data)
        assert info["used"] == {"cpus": 1, "memory_mb": 256} and info["machines"] == 1

        wanted = {("stdout", f"ready on {started['port']} as {mid}"), ("stderr", "oops")}

        async def lines_published() -> bool:  # the log follower reads every quarter second (workers/output.py)
            return wanted <= {(entry["stream"], entry["line"]) for entry in logs}

        await until(lines_published, "the machine's stdout and stderr lines on its log subject", 10)

        listed = await raw.ok("list", b"")
        assert [m["id"] for m in listed] == [mid]
        assert (await raw.send("start", {"id": mid}))[0] == 200  # idempotent while started
        code, body = await raw.send("destroy", {"id": mid})
        assert code == 409 and "stop it first" in body["error"]["message"]

        stopped = await raw.ok("stop", {"id": mid, "timeout": 5})
        assert stopped["state"] == "stopped" and stopped["exit"]["signal"] == 15 and stopped["exit"]["requested_stop"]
        destroyed = await raw.ok("destroy", {"id": mid})
        assert destroyed["state"] == "destroyed"
        code, _ = await raw.send("start", {"id": mid})
        assert code == 409

        got = await raw.ok("get", {"id": mid})
        statuses = [e["status"] for e in reversed(got["events"]) if e["type"] == "transition"]
        assert statuses == ["created", "starting", "started", "stopping", "stopped", "destroying", "destroyed"]

        def published() -> list[str]:
            return [e["status"] for e in events if e["machine_id"] == mid and e["type"] == "transition"]

        async def all_published() -> bool:
            return len(published()) >= len(statuses)

        await until(all_published, "every transition published", 10)
        assert published() == statuses
        kv = await nc.jetstream().key_value("fauxmad_workers")
        beat = json.loads((await kv.get(f"{worker.region}.{worker.worker_id}")).value)
        assert beat["worker_id"] == worker.worker_id and beat["capacity"] == {"cpus": 2, "memory_mb": 1024}
        await nc.close()

    arun(main())


def test_errors_unknown_machine_illegal_transition_and_leases(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        code, body = await raw.send("get", {"id": "00000000000000"})
        assert code == 404 and body == {"error": {"code": 404, "message": body["error"]["message"]}}
        machine = await raw.ok("reserve", {"app": "a", "region": worker.region, "config": {"cmd": SLEEPER}})
        mid = machine["id"]
        code, _ = await raw.send("signal", {"id": mid, "signal": "SIGHUP"})
        assert code == 409  # not started
        lease = await raw.ok("lease", {"id": mid, "ttl": 30, "holder": "deployer"})
        code, body = await raw.send("start", {"id": mid})
        assert code == 409 and "leased by deployer" in body["error"]["message"]
        code, _ = await raw.send("lease", {"id": mid, "ttl": 5, "holder": "other"})
        assert code == 409
        await raw.ok("start", {"id": mid, "lease_nonce": lease["nonce"]})
        await raw.ok("release", {"id": mid, "nonce": lease["nonce"]})
        await raw.ok("stop", {"id": mid, "signal": "SIGKILL"})
        code, _ = await raw.send("wait", {"id": mid, "state": "started", "timeout": 0.2})
        assert code == 504
        code, _ = await raw.send("reserve", {"app": "a", "region": "elsewhere", "config": {"cmd": SLEEPER}})
        assert code == 400
        code, _ = await raw.send(
            "reserve", {"app": "a", "region": worker.region, "config": {"cmd": SLEEPER, "guest": {"cpus": 64}}}
        )
        assert code == 503
        await nc.close()

    arun(main())


def test_cordon_declines_offers_and_reservations(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        info = json.loads(
            (await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.cordon", b'{"reason": "kernel upgrade"}')).data
        )
        assert info["cordoned"] is True
        offer = json.loads(
            (
                await nc.request(
                    f"fauxmad.v1.offers.{worker.region}", json.dumps({"app": "a", "region": worker.region}).encode()
                )
            ).data
        )
        assert offer == {**offer, "type": "decline", "reason": "cordoned"}
        code, _ = await raw.send("reserve", {"app": "a", "region": worker.region, "config": {"cmd": SLEEPER}})
        assert code == 503
        info = json.loads((await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.uncordon", b"")).data)
        assert info["cordoned"] is False
        await raw.ok("reserve", {"app": "a", "region": worker.region, "config": {"cmd": SLEEPER}})
        await nc.close()

    arun(main())


def test_offer_answers_follow_every_change(worker_factory: Callable[..., WorkerProcess]) -> None:
    """The same question asked again is answered from the last answer only while nothing changed: a reserve, a
    cordon and an uncordon each show in the next offer; a malformed question is a 400, not a cached answer."""
    worker = worker_factory(cpus=2, memory_mb=1024)

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        question = json.dumps({"app": "a", "region": worker.region, "guest": {"cpus": 1, "memory_mb": 256}}).encode()

        async def ask() -> dict[str, object]:
            reply = await nc.request(f"fauxmad.v1.offers.{worker.region}", question)
            return dict(json.loads(reply.data))

        first = await ask()
        assert first["type"] == "offer" and first["free"] == {"cpus": 2, "memory_mb": 1024}
        assert await ask() == first
        await raw.ok("reserve", {"app": "a", "region": worker.region, "config": {"cmd": SLEEPER}})
        after = await ask()
        assert after["free"] == {"cpus": 1, "memory_mb": 768} and after["app_machines"] == 1
        await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.cordon", b"")
        assert (await ask())["reason"] == "cordoned"
        await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.uncordon", b"")
        assert await ask() == after
        bad = await nc.request(f"fauxmad.v1.offers.{worker.region}", b'{"app": "a"}')
        assert bad.headers is not None and bad.headers.get("Nats-Service-Error-Code") == "400"
        await nc.close()

    arun(main())


def test_concurrent_reservers_never_overcommit(worker_factory: Callable[..., WorkerProcess]) -> None:
    capacity = 3
    worker = worker_factory(cpus=capacity, memory_mb=capacity * 256)

    async def main() -> None:
        clients = [await nats.connect(worker.nats_url) for _ in range(8)]
        raws = [RawClient(nc, worker.worker_id) for nc in clients]
        reserve = {"app": "race", "region": worker.region, "config": {"cmd": SLEEPER}}
        for trial in range(25):
            results = await asyncio.gather(*[raw.send("reserve", reserve) for raw in raws])
            codes = sorted(code for code, _ in results)
            assert codes == [200] * capacity + [503] * (8 - capacity), (trial, codes)
            for code, body in results:
                if code == 200:
                    await raws[0].ok("destroy", {"id": body["id"]})
            info = json.loads((await clients[0].request(f"fauxmad.v1.worker.{worker.worker_id}.info", b"")).data)
            assert info["used"]["cpus"] == 0
        for nc in clients:
            await nc.close()

    arun(main())


def test_idempotency_key_returns_the_same_machine(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        payload = {"app": "a", "region": worker.region, "config": {"cmd": SLEEPER}, "idempotency_key": "order-42"}
        results = await asyncio.gather(*[raw.ok("reserve", payload) for _ in range(6)])
        assert len({m["id"] for m in results}) == 1
        assert len(await raw.ok("list", {})) == 1
        await nc.close()

    arun(main())


def test_derived_tables_rebuilt_from_the_log_equal_the_live_ones(
    worker_factory: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    worker = worker_factory(cpus=8, memory_mb=8192)

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        ids = []
        for i in range(6):
            m = await raw.ok(
                "reserve",
                {
                    "app": "a",
                    "region": worker.region,
                    "idempotency_key": f"k{i}",
                    "config": {"cmd": ["sh", "-c", f"exit {i % 2}"], "restart": {"policy": "no"}},
                },
            )
            ids.append(m["id"])
        for mid in ids[:4]:
            await raw.ok("start", {"id": mid})
        for mid in ids[:4]:
            await raw.ok("wait", {"id": mid, "state": "stopped" if ids.index(mid) % 2 == 0 else "failed"})
        await raw.ok("destroy", {"id": ids[0]})
        await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.cordon", b"")
        await nc.close()

    arun(main())
    worker.terminate()
    from workers.log.store import Store

    store = Store(worker.data_dir / "lmdb")
    live = store.snapshot()
    assert store.rebuild() == live
    assert live.usage.machines == 5 and live.worker.cordoned
    states = sorted(s.machine.state for s in live.machines.values())
    assert states == ["created", "created", "destroyed", "failed", "failed", "stopped"]
