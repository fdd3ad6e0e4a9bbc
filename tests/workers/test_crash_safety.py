"""kill -9 of the worker: acknowledged reservations survive, machines keep running and are re-adopted,
and an exit that happened while the worker was down is still recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import nats

from tests.helpers import RawClient, WorkerProcess, arun, pid_alive, wait_output, wait_until


def test_kill9_keeps_machines_and_every_acknowledged_reservation(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory(cpus=64, memory_mb=64 * 1024)
    state: dict[str, object] = {}

    async def before() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        long_runner = await raw.ok(
            "reserve",
            {"app": "k", "region": worker.region, "config": {"cmd": ["sleep", "120"], "restart": {"policy": "no"}}},
        )
        short_runner = await raw.ok(
            "reserve",
            {
                "app": "k",
                "region": worker.region,
                "config": {"cmd": ["sh", "-c", "sleep 1.5; exit 7"], "restart": {"policy": "no"}},
            },
        )
        long_runner = await raw.ok("start", {"id": long_runner["id"]})
        short_runner = await raw.ok("start", {"id": short_runner["id"]})
        pids = {}
        for m in (long_runner, short_runner):
            pid_file = worker.data_dir / "machines" / m["id"] / "child.pid"
            for _ in range(100):  # the shim writes it right after it forks the workload
                if pid_file.exists() and pid_file.read_text().strip():
                    break
                await asyncio.sleep(0.02)
            pids[m["id"]] = int(pid_file.read_text())
        state["long"], state["short"], state["pids"] = long_runner["id"], short_runner["id"], pids

        # a stream of reservations in flight when the worker dies: every acknowledged one must survive
        acked: list[str] = []

        async def reserver() -> None:
            while True:
                try:
                    code, body = await raw.send(
                        "reserve", {"app": "k", "region": worker.region, "config": {"cmd": ["true"]}}, timeout=1
                    )
                except Exception:
                    return
                if code == 200:
                    acked.append(body["id"])

        tasks = [asyncio.create_task(reserver()) for _ in range(4)]
        # reserves in flight when the worker is killed: the kill lands mid-load
        await asyncio.sleep(0.3)
        worker.kill9()
        await asyncio.gather(*tasks)
        state["acked"] = acked
        await nc.close()

    arun(before())
    assert len(state["acked"]) > 10  # type: ignore[arg-type]
    pids: dict[str, int] = state["pids"]  # type: ignore[assignment]
    assert all(pid_alive(pid) for pid in pids.values()), "machines must outlive the worker"
    short, long = pids[state["short"]], pids[state["long"]]  # type: ignore[index]
    wait_until(lambda: not pid_alive(short), "the short runner exiting while nobody watches")  # code 7
    assert pid_alive(long)
    worker.start()

    async def after() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        listed = {m["id"]: m for m in await raw.ok("list", {})}
        missing = [mid for mid in state["acked"] if mid not in listed]  # type: ignore[attr-defined]
        assert not missing, f"{len(missing)} acknowledged reservations lost"
        long_runner = listed[state["long"]]  # type: ignore[index]
        assert long_runner["state"] == "started"
        assert pid_alive(pids[long_runner["id"]])  # the same process, re-adopted
        short_runner = await raw.ok("get", {"id": state["short"]})
        assert short_runner["state"] == "failed" and short_runner["exit"]["exit_code"] == 7
        # re-adopted means supervised: a stop reaches the same process and its exit is learned
        stopped = await raw.ok("stop", {"id": long_runner["id"], "timeout": 5})
        assert stopped["state"] == "stopped" and stopped["exit"]["signal"] == 15
        assert not pid_alive(pids[long_runner["id"]])
        await nc.close()

    arun(after())


def test_restart_resumes_a_stop_that_was_in_flight(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def before() -> str:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        m = await raw.ok(
            "reserve",
            {
                "app": "k",
                "region": worker.region,
                "config": {"cmd": ["sh", "-c", "trap '' TERM; echo armed; sleep 120"]},
            },
        )
        await raw.ok("start", {"id": m["id"]})
        await wait_output(worker, m["id"], "armed")
        # a TERM-ignoring process: the stop waits for its timeout, and the worker dies meanwhile
        stopping = asyncio.create_task(raw.send("stop", {"id": m["id"], "timeout": 30}, timeout=40))
        await raw.wait_state(m["id"], "stopping")
        worker.kill9()
        stopping.cancel()
        await nc.close()
        return str(m["id"])

    mid = arun(before())
    worker.start()

    async def after() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        # nobody asks for the stop again: only the restarted worker's resume of it can end the TERM-ignoring
        # process, by escalating to SIGKILL after the worker's stop timeout (10 s). Without that resume the
        # machine stays `stopping` for good (the state recorded before the kill), and this wait fails
        stopped = await raw.wait_state(mid, "stopped", timeout=60)
        assert stopped["state"] == "stopped"
        destroyed = await raw.ok("destroy", {"id": mid})
        assert destroyed["state"] == "destroyed"
        await nc.close()

    arun(after())


def test_heartbeat_key_expires_when_the_worker_dies(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        kv = await nc.jetstream().key_value("fauxmad_workers")
        key = f"{worker.region}.{worker.worker_id}"
        assert json.loads((await kv.get(key)).value)["worker_id"] == worker.worker_id
        watcher = await kv.watch(key, include_history=False)
        worker.kill9()

        async def removed() -> str:
            async for entry in watcher:
                if entry is not None and entry.operation in ("DEL", "PURGE"):
                    return str(entry.operation)
            return ""

        # the event is the key's removal with nobody left to remove it (the worker is dead): the bucket's TTL did.
        # 30 s only bounds a wait for a removal that never comes (the TTL is a few heartbeats)
        assert await asyncio.wait_for(removed(), 30) in ("DEL", "PURGE")
        await nc.close()

    arun(main())
