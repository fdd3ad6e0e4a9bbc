"""Local supervision on a real worker: restart policies with counts, OOM reported, health checks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from tests.helpers import RawClient, WorkerProcess, arun
from workers.driver.limits import auto_detect


def test_on_failure_restarts_up_to_max_retries_then_fails(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        m = await raw.ok(
            "reserve",
            {
                "app": "crash",
                "region": worker.region,
                "config": {"cmd": ["sh", "-c", "exit 3"], "restart": {"policy": "on-failure", "max_retries": 2}},
            },
        )
        await raw.ok("start", {"id": m["id"]})
        failed = await raw.wait_state(m["id"], "failed", timeout=15)
        assert failed["restarts"] == 2 and failed["exit"]["exit_code"] == 3
        got = await raw.ok("get", {"id": m["id"]})
        exits = [e for e in got["events"] if e["type"] == "exit"]
        assert len(exits) == 3  # the first run and two restarts
        await nc.close()

    arun(main())


def test_always_restarts_a_clean_exit_and_no_never_does(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        always = await raw.ok(
            "reserve",
            {
                "app": "r",
                "region": worker.region,
                "config": {"cmd": ["sh", "-c", "sleep 0.1"], "restart": {"policy": "always"}},
            },
        )
        never = await raw.ok(
            "reserve",
            {
                "app": "r",
                "region": worker.region,
                "config": {"cmd": ["sh", "-c", "exit 1"], "restart": {"policy": "no"}},
            },
        )
        await raw.ok("start", {"id": always["id"]})
        await raw.ok("start", {"id": never["id"]})
        assert (await raw.wait_state(never["id"], "failed"))["restarts"] == 0
        for _ in range(100):
            got = await raw.ok("get", {"id": always["id"]})
            if got["restarts"] >= 2:
                break
            await asyncio.sleep(0.1)
        assert got["restarts"] >= 2
        stopped = await raw.ok("stop", {"id": always["id"]})
        assert stopped["state"] == "stopped"
        await nc.close()

    arun(main())


@pytest.mark.skipif(auto_detect("probe").describe() == "rlimit", reason="no writable cgroup memory controller here")
def test_out_of_memory_is_reported(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        hog = "import time; b = bytearray(300 * 1024 * 1024); time.sleep(5)"
        m = await raw.ok(
            "reserve",
            {
                "app": "hog",
                "region": worker.region,
                "config": {
                    "cmd": ["python3", "-c", hog],
                    "guest": {"cpus": 1, "memory_mb": 64},
                    "restart": {"policy": "no"},
                },
            },
        )
        await raw.ok("start", {"id": m["id"]})
        failed = await raw.wait_state(m["id"], "failed", timeout=20)
        assert failed["exit"]["oom_killed"] is True
        got = await raw.ok("get", {"id": m["id"]})
        assert any("out of memory" in (e.get("reason") or "") for e in got["events"])
        await nc.close()

    arun(main())


def test_health_check_status_follows_the_service(worker_factory: Callable[..., WorkerProcess], tmp_path: Path) -> None:
    worker = worker_factory()
    flag = tmp_path / "healthy"

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        server = "import http.server, os; http.server.HTTPServer(('127.0.0.1', int(os.environ['PORT'])), http.server.SimpleHTTPRequestHandler).serve_forever()"
        m = await raw.ok(
            "reserve",
            {
                "app": "web",
                "region": worker.region,
                "config": {
                    "cmd": ["python3", "-c", server],
                    "checks": {
                        "http": {"type": "http", "path": "/", "interval": "200ms", "timeout": "1s"},
                        "flag": {"type": "cmd", "command": ["test", "-f", str(flag)], "interval": "100ms"},
                    },
                },
            },
        )
        await raw.ok("start", {"id": m["id"]})

        async def statuses() -> dict[str, str]:
            got = await raw.ok("get", {"id": m["id"]})
            return {name: c["status"] for name, c in got["checks"].items()}

        async def until(expected: dict[str, str]) -> None:
            for _ in range(100):
                if await statuses() == expected:
                    return
                await asyncio.sleep(0.1)
            got = await raw.ok("get", {"id": m["id"]})
            raise AssertionError(f"checks stayed {await statuses()}, wanted {expected}: {got['checks']}")

        await until({"http": "passing", "flag": "critical"})
        flag.write_text("ok")
        await until({"http": "passing", "flag": "passing"})
        flag.unlink()
        await until({"http": "passing", "flag": "critical"})
        got = await raw.ok("get", {"id": m["id"]})
        assert sum(e["type"] == "check" for e in got["events"]) >= 4
        await raw.ok("stop", {"id": m["id"]})
        assert (await raw.ok("get", {"id": m["id"]}))["checks"] == {}
        await nc.close()

    arun(main())


SLOW_STOP = "trap 'sleep 1; exit 0' TERM; while :; do sleep 0.1; done"  # ends 1 s after its SIGTERM


async def stopping_machine(
    raw: RawClient, region: str, app: str, **config: object
) -> tuple[str, asyncio.Task[tuple[int, Any]]]:
    """A started machine whose stop (5 s timeout) is in flight and recorded `stopping`: its id, and the stop."""
    m = await raw.ok("reserve", {"app": app, "region": region, "config": {"cmd": ["sh", "-c", SLOW_STOP], **config}})
    await raw.ok("start", {"id": m["id"]})
    stop = asyncio.create_task(raw.send("stop", {"id": m["id"], "timeout": 5}))
    await raw.wait_state(m["id"], "stopping")
    return m["id"], stop


def test_a_start_of_a_machine_still_stopping_waits_for_the_stop_then_starts_it(
    worker_factory: Callable[..., WorkerProcess],
) -> None:
    """A start that meets a stop halfway (an edge's request during the machine's autostop, CI110) is not refused
    as `stopping`: it waits for the stop to end, then starts the machine. Here the workload takes 1 s to end after
    its SIGTERM; the start goes in meanwhile."""
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        machine_id, stop = await stopping_machine(raw, worker.region, "slowstop")
        code, body = await raw.send("start", {"id": machine_id}, timeout=20)
        assert code == 200, body
        assert body["state"] == "started"
        stop_code, stopped = await stop
        assert stop_code == 200, stopped
        assert stopped["state"] in ("stopped", "starting", "started")  # its answer may come after the start
        got = await raw.ok("get", {"id": machine_id})
        states = [e["status"] for e in got["events"] if e["type"] == "transition"]  # newest first
        assert states[:4] == ["started", "starting", "stopped", "stopping"], states
        await nc.close()

    arun(main())


def test_a_start_of_a_machine_that_destroys_itself_once_stopped_is_refused_while_it_stops(
    worker_factory: Callable[..., WorkerProcess],
) -> None:
    """An `auto_destroy` machine's stop destroys it: a start while it stops is refused at once (409), not started
    only to be destroyed a moment later."""
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        machine_id, stop = await stopping_machine(raw, worker.region, "once", auto_destroy=True)
        code, body = await raw.send("start", {"id": machine_id})
        assert code == 409 and "stopping" in body["error"]["message"], body
        await stop
        await raw.wait_state(machine_id, "destroyed")
        await nc.close()

    arun(main())
