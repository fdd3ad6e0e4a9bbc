"""The executor's leases against a real worker: kept for as long as a long action runs (renewed), so a short
TTL is safe; and a reconciler that dies holding one (no release) blocks the next one for one TTL only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bus.contract.errors import Conflict, Unreachable
from bus.contract.machines import MachineConfig
from bus.transport.jetstream import ensure_fleet_resources
from orchestrator.reconcile import executor as executor_module
from orchestrator.reconcile.actions import Destroy, Start, Stop, Update
from orchestrator.reconcile.executor import Executor, Result
from orchestrator.reconcile.observe import Observer
from orchestrator.reconcile.over_nats import NatsBus
from orchestrator.replicas.workers import Registry
from tests.helpers import RawClient, arun, connect_nats, wait_output

REPO = Path(__file__).resolve().parents[3]
TTL = 0.6  # seconds: the test's stand-in for LEASE_TTL
# Takes its whole stop timeout to stop, once armed: `started` means the process exists, not that it has run
# its first line, so a stop sent before the trap is set kills it at once (it did, on a fast host, every time).
DEAF = ["sh", "-c", "trap '' TERM; echo armed; while true; do sleep 0.1; done"]


def test_a_long_action_keeps_its_lease_and_a_dead_holders_lease_lapses_after_one_ttl(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor_module, "LEASE_TTL", TTL)
    worker = worker_factory(unique("r"))
    worker_id: str = worker.worker_id  # type: ignore[attr-defined]
    region: str = worker.region  # type: ignore[attr-defined]

    async def scenario() -> tuple[list[int], list[tuple[float, object]], float]:
        nc = await connect_nats(nats_url)
        raw = RawClient(nc, worker_id)
        try:
            machine = await raw.ok("reserve", {"app": "a", "region": region, "config": {"cmd": DEAF}, "launch": True})
            await raw.wait_state(machine["id"], "started")
            await wait_output(worker, machine["id"], "armed")  # type: ignore[arg-type]
            executor = Executor(NatsBus(nc), machines=None, holder="deploy", stop_timeout=4 * TTL)  # type: ignore[arg-type]
            stop = Stop(id=machine["id"], region=region, worker_id=worker_id)
            stopping = asyncio.create_task(executor.apply("a", (stop,)))
            while ((await raw.ok("get", {"id": machine["id"]})).get("lease") or {}).get("holder") != "deploy":
                await asyncio.sleep(0.01)
            refused = []  # another reconciler asks for the lease while the stop runs, past several TTLs
            while not stopping.done():
                code, body = await raw.send("lease", {"id": machine["id"], "ttl": TTL, "holder": "other"})
                if code == 200:
                    # its last ask raced the stop's end: the deploy released the lease after the machine stopped and
                    # before its apply returned here (CI37). Granted only once the action was over, and given back,
                    # so the dead holder below finds the machine free
                    assert (await raw.ok("get", {"id": machine["id"]}))["state"] == "stopped", body
                    await raw.ok("release", {"id": machine["id"], "nonce": body["nonce"]})
                    break
                refused.append(code)
                await asyncio.sleep(TTL / 4)
            (result,) = await stopping
            assert result.ok, result.error
            # a reconciler killed holding the lease (nothing releases it): the next one gets the machine one TTL on
            dead = await raw.ok("lease", {"id": machine["id"], "ttl": TTL, "holder": "killed"})
            assert dead["holder"] == "killed"
            start = Start(id=machine["id"], region=region, worker_id=worker_id)
            codes: list[tuple[float, object]] = []
            while True:
                asked = time.time()  # the worker's clock is this host's: its expires_at compares with it
                (result,) = await executor.apply("a", (start,))
                codes.append((asked, result.error_type if not result.ok else None))
                if result.ok:
                    return refused, codes, float(dead["expires_at"])
                await asyncio.sleep(TTL / 4)
        finally:
            await nc.close()

    refused, codes, expires_at = arun(scenario())
    assert len(refused) >= 8 and set(refused) == {409}, refused  # the lease was renewed the whole time
    assert codes[0][1] is Conflict and codes[-1][1] is None, codes
    # the machine is the next reconciler's once the dead holder's lease expires, and not later: every start asked
    # after the expiry succeeded (an ordering against the lease's own expiry, not a bound on the clock)
    assert all(error is None for asked, error in codes if asked > expires_at), (codes, expires_at)


# The promise (docs/explanation/faults.md, "Deadlines that follow progress"): a lease lapses 6 s after its holder
# stopped renewing it. Its renewal in flight at the kill may still land: the margin is that one round trip.
DEAD_HOLDER_LAPSES_WITHIN = 6.0
RENEWAL_IN_FLIGHT = 1.0
HOLDER = """
import asyncio, sys
import nats
from orchestrator.reconcile.executor import Executor
from orchestrator.reconcile.over_nats import NatsBus
from orchestrator.replicas.workers import Registry
from orchestrator.reconcile.actions import Stop

async def main(url, machine_id, region, worker_id):
    nc = await nats.connect(url)
    executor = Executor(NatsBus(nc), machines=None, holder="doomed", stop_timeout=120)
    await executor.apply("a", (Stop(id=machine_id, region=region, worker_id=worker_id),))

asyncio.run(main(*sys.argv[1:]))
"""


def test_a_holder_killed_with_9_frees_its_machine_one_ttl_after_its_last_renewal(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    """A real reconciler process (the product's LEASE_TTL) holds a machine's lease through a long stop, renewing
    it, and is killed with -9 (nothing releases the lease): the lease lapses within one TTL of its last renewal,
    and the next holder's destroy, refused until then, goes through right after. Fails with the 15 s TTL."""
    worker = worker_factory(unique("r"))
    worker_id: str = worker.worker_id  # type: ignore[attr-defined]
    region: str = worker.region  # type: ignore[attr-defined]

    async def scenario() -> tuple[float, list[tuple[float, object]]]:
        nc = await connect_nats(nats_url)
        raw = RawClient(nc, worker_id)
        try:
            machine = await raw.ok("reserve", {"app": "a", "region": region, "config": {"cmd": DEAF}, "launch": True})
            await raw.wait_state(machine["id"], "started")
            await wait_output(worker, machine["id"], "armed")  # type: ignore[arg-type]
            holder = await asyncio.create_subprocess_exec(
                sys.executable, "-c", HOLDER, nats_url, machine["id"], region, worker_id, cwd=REPO
            )
            try:
                first_expiry = None
                while True:  # until the holder has renewed its lease once: it is working
                    lease = (await raw.ok("get", {"id": machine["id"]})).get("lease") or {}
                    if lease.get("holder") == "doomed":
                        first_expiry = first_expiry or lease["expires_at"]
                        if lease["expires_at"] > first_expiry:
                            break
                    assert holder.returncode is None, "the holder ended before it renewed its lease"
                    await asyncio.sleep(0.05)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    holder.kill()
                killed_at = time.time()
                await holder.wait()
            executor = Executor(NatsBus(nc), machines=None, holder="next", stop_timeout=1)  # type: ignore[arg-type]
            destroy = Destroy(id=machine["id"], region=region, worker_id=worker_id)
            codes: list[tuple[float, object]] = []
            while True:
                asked = time.time()
                (result,) = await executor.apply("a", (destroy,))
                codes.append((asked, result.error_type if not result.ok else None))
                if result.ok:
                    break
                assert asked - killed_at < 60, codes  # the lease never lapsed
                await asyncio.sleep(0.2)
            return killed_at, codes
        finally:
            await nc.close()

    killed_at, codes = arun(scenario())
    assert codes[0][1] is Conflict, codes  # the dead holder's lease held the machine at first
    freed_at = codes[-1][0]
    # the machine was refused until the lease lapsed, and the lapse came one TTL after the last renewal at most
    assert freed_at - killed_at <= DEAD_HOLDER_LAPSES_WITHIN + RENEWAL_IN_FLIGHT + 0.5, (freed_at - killed_at, codes)


def test_an_action_on_a_worker_frozen_mid_call_fails_as_soon_as_its_heartbeat_expires(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    """A host frozen while an action waits on it: the action fails as lost when the worker's heartbeat expires,
    not at its own timeout (an update's is 40 s), so the pass behind it goes on to fail the host over."""
    worker = worker_factory(unique("r"))
    worker_id: str = worker.worker_id  # type: ignore[attr-defined]
    region: str = worker.region  # type: ignore[attr-defined]
    pid: int = worker.proc.pid  # type: ignore[attr-defined]
    # a host of the fleet keeps beating: a bucket where nobody beats is the store's silence, not a lost worker
    worker_factory(region)

    async def scenario() -> Result:
        nc = await connect_nats(nats_url)
        raw = RawClient(nc, worker_id)
        registry = Registry()
        try:
            machine = await raw.ok("reserve", {"app": "a", "region": region, "config": {"cmd": DEAF}, "launch": True})
            await raw.wait_state(machine["id"], "started")
            await registry.start((await ensure_fleet_resources(nc.jetstream())).workers)
            assert registry.is_live(worker_id)
            observer = Observer(NatsBus(nc), registry=registry)
            executor = Executor(NatsBus(nc), machines=None, holder="op", lost=observer.lost)  # type: ignore[arg-type]
            update = Update(
                id=machine["id"],
                region=region,
                worker_id=worker_id,
                config=MachineConfig(cmd=["sleep", "60"]),
                restarts=True,
            )
            os.kill(pid, signal.SIGSTOP)  # frozen before the lease is asked: every call of the update waits
            try:
                (result,) = await executor.apply("a", (update,))
            finally:
                os.kill(pid, signal.SIGCONT)
            return result
        finally:
            await registry.close()
            await nc.close()

    result = arun(scenario())
    assert not result.ok and result.error_type is Unreachable, result
    assert f"worker {worker_id} was lost" in result.error, result.error
