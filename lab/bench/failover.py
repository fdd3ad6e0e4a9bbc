"""Failover, timed: kill a host while the operator runs; how long until its primary's spare is started.

Its own fleet in one region; an app of N primaries, each with one spare on another worker. Each round
waits for a settled app, SIGKILLs the worker of one primary and its machine processes at once
(`DevFleet.kill_host`), and polls the spare's worker until the spare is started; then the host comes
back (the operator stops what it replaced, keeping it as a spare) for the next round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import uvloop

from bus.contract import subjects
from bus.contract.machines import ListRequest, Machine
from lab.bench import BenchError
from lab.bench.deploy import APP, bench_fleet, bench_spec
from lab.bench.report import Report, Table
from lab.bench.stats import summarize
from orchestrator.devfleet import DevFleet
from orchestrator.reconcile import rollout
from orchestrator.reconcile.reconciler import Reconciler
from orchestrator.reconcile.watch import Operator

REGION = "mad"
SETTLE_TIMEOUT = 60.0
FAILOVER_TIMEOUT = 30.0


class FailoverOptions(msgspec.Struct, frozen=True, kw_only=True):
    rounds: int = 3
    workers: int = 3  # in the one region
    machines: int = 2  # primaries, each with one spare


class FailoverResult(msgspec.Struct, kw_only=True):
    rounds: int
    seconds: list[float]
    p50_s: float
    max_s: float


async def _spare_started(operator: Reconciler, worker_id: str, machine_id: str) -> bool:
    subject = subjects.worker_machines(worker_id, "list")
    found = await operator.bus.call(subject, ListRequest(app=APP), list[Machine], timeout=2)
    return any(m.id == machine_id and m.state == "started" for m in found)


async def _one_failover(fleet: DevFleet, operator: Reconciler, round_: int, progress: Callable[[str], None]) -> float:
    deadline = time.perf_counter() + SETTLE_TIMEOUT
    while True:  # a settled app: every primary healthy with its spare
        found = await operator.observer.observe(APP, [REGION])
        ps = [m for m in found.machines if m.role == "primary" and m.state == "started" and m.healthy]
        spares = {m.standby_of: m for m in found.machines if m.role == "spare" and m.state in ("created", "stopped")}
        if ps and all(p.id in spares for p in ps) and not found.lost:
            break
        if time.perf_counter() > deadline:
            raise BenchError(f"round {round_ + 1}: the app did not settle within {SETTLE_TIMEOUT:g}s")
        await asyncio.sleep(0.2)
    victim = ps[0]
    standby = spares[victim.id]
    fleet.kill_host(victim.worker_id)
    killed = time.perf_counter()
    while not await _spare_started(operator, standby.worker_id, standby.id):
        if time.perf_counter() - killed > FAILOVER_TIMEOUT:
            raise BenchError(f"round {round_ + 1}: the spare {standby.id} did not start within {FAILOVER_TIMEOUT:g}s")
        await asyncio.sleep(0.02)
    took = time.perf_counter() - killed
    progress(f"round {round_ + 1}: killed {victim.worker_id}; spare {standby.id} started after {took:.2f}s")
    fleet.respawn(f"worker-{victim.worker_id}")
    return took


def run_failover(options: FailoverOptions, progress: Callable[[str], None] = lambda line: None) -> FailoverResult:
    async def rounds(fleet: DevFleet) -> list[float]:
        operator = await Reconciler.connect(fleet.url)
        stop = asyncio.Event()
        try:
            outcome = await rollout.deploy(
                operator, bench_spec(APP, [REGION], options.machines, version="v1", spares=1)
            )
            if not outcome.ok:
                raise BenchError(outcome.message)
            watching = asyncio.create_task(Operator(operator).watch([APP], stop))
            try:
                return [await _one_failover(fleet, operator, i, progress) for i in range(options.rounds)]
            finally:
                stop.set()
                await watching
        finally:
            await operator.close()

    with bench_fleet([REGION], options.workers, max(2, options.machines), progress) as fleet:
        samples = uvloop.run(rounds(fleet))
    lat = summarize(samples)
    return FailoverResult(
        rounds=options.rounds,
        seconds=[round(s, 3) for s in samples],
        p50_s=lat.p50_ms / 1000,
        max_s=lat.max_ms / 1000,
    )


def report(result: FailoverResult) -> Report:
    rows = tuple((str(i + 1), f"{s:.2f}") for i, s in enumerate(result.seconds))
    table = Table(title="host death -> spare started", columns=("round", "seconds"), align="rr", rows=rows)
    note = f"{result.rounds} rounds: p50 {result.p50_s:.2f}s, max {result.max_s:.2f}s (heartbeat 1s, worker TTL 3s)"
    return Report(tables=(table,), notes=(note,))
