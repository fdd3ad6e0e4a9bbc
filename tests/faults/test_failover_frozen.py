"""A silent host must not slow failover: the spare starts within a second of the heartbeat expiring.

Before the fix every pass of the operator asked each worker it believed alive with a 5 s timeout, so
a frozen worker (SIGSTOP: a partition, a host stuck in the kernel) held up the pass that was waiting on
it, and the spare started about three seconds after the heartbeat key expired.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import nats

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture, start_operator, wait_until
from tests.orchestrator.reconcile.test_reconcile import destroy, fauxmad, machines, primaries, spares, write_spec

fleet = fleet_fixture(FleetSpec(regions=["syd"], workers_per_region=3, cpus=6, memory_mb=6144, brokers=1))


async def expiry_to_spare_started(fleet: DevFleet, worker_id: str, standby_id: str, pid: int) -> float:
    """Freeze the worker; return the seconds from its heartbeat key expiring to its spare's `started`."""
    nc = await connect_nats(fleet.url)
    try:
        kv = await nc.jetstream().key_value("fauxmad_workers")
        watcher = await kv.watch(f"syd.{worker_id}", include_history=False)
        started_at: list[float] = []

        async def on_event(msg: nats.aio.msg.Msg) -> None:
            event = msgspec.json.decode(msg.data)
            if event["status"] == "started" and not started_at:
                started_at.append(time.perf_counter())

        sub = await nc.subscribe(f"fauxmad.v1.events.syd.*.ha.{standby_id}", cb=on_event)
        os.kill(pid, signal.SIGSTOP)
        expired_at = None
        deadline = time.perf_counter() + 20
        while expired_at is None and time.perf_counter() < deadline:
            try:
                entry = await watcher.updates(timeout=1)
            except nats.errors.TimeoutError:
                continue
            if entry is not None and entry.operation in ("DEL", "PURGE"):
                expired_at = time.perf_counter()
        assert expired_at is not None, "the frozen worker's heartbeat never expired"
        while not started_at and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
        assert started_at, "the spare never started"
        await sub.unsubscribe()
        await watcher.stop()
        return started_at[0] - expired_at
    finally:
        await nc.close()


def test_a_frozen_host_fails_over_within_a_second_of_its_heartbeat_expiring(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", "ha", regions="syd = 2", spares=1)
    assert fauxmad(fleet, "deploy", "-c", str(spec)).returncode == 0
    wait_until(lambda: len(spares(machines(fleet, "ha"))) == 2, "two spares", 10)
    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, "ha")
    pid = 0
    try:
        found = machines(fleet, "ha")
        victim = primaries(found)[0]
        standby = next(s for s in spares(found) if s.config.standbys == [victim.id])
        pid = next(p.pid for name, p in fleet.processes if name == f"worker-{victim.worker_id}")
        late = arun(expiry_to_spare_started(fleet, victim.worker_id, standby.id, pid))
        print(f"\nheartbeat expired -> spare started: {late:.3f}s")
        # the time is the promise (this module's: within a second of the expiry; the unfixed operator took about
        # 3 s, a pass waiting out its 5 s ask of the frozen worker). 2 s leaves a second of margin for a host
        # running two test files at a time and still fails the unfixed operator most runs
        assert late < 2.0, f"the spare started {late:.2f}s after the heartbeat expired (target: under 1 s)"
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
        operator.send_signal(signal.SIGINT)
        code = operator.wait(20)
    assert code == 0, log.read_text()
    destroy(fleet, "ha")
