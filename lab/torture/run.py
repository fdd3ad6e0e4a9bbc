"""One torture run: the fleet up, the clients and the nemesis for the duration, a settle, the final snapshot,
the operator probe, the fleet down, the history checked.

Why it exists: to tie the pieces in the one order that makes a history judgeable: the workload and the
faults start together and stop together, then every process is brought back up and the fleet is given
time to settle before the final look (the checker's "at the end"). The fleet is torn down whatever
happens; the run directory (the history, every process's log, the workers' data) is kept with `keep`,
and also when the run found violations or failed, else removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import uvloop

from lab.torture.check import Verdict, Violation, check
from lab.torture.fleet import OPERATOR_APP, TortureError, TortureFleet
from lab.torture.history import End, HistoryWriter, Meta, load
from lab.torture.nemesis import Nemesis
from lab.torture.plan import FAULT_KINDS, GAP_S, fault_schedule
from lab.torture.sampler import Sampler
from lab.torture.workload import Client

CLIENTS = 5
SETTLE_S = 10.0
CLIENT_DRAIN_S = 30.0  # at most this long for the clients' last requests after the duration
# on hosts, one fault every 2-4 s (after the last one's recovery): a short run still strikes with every kind
HOSTS_GAP = 2.0  # on hosts a fault every 2-4 s: more kinds to strike in a run
HOSTS_SETTLE_S = 20.0  # on hosts, connections through a cut server are noticed dead by pings (seconds), then settle


class TortureOptions(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    duration: float = 90.0
    faults: tuple[str, ...] = FAULT_KINDS
    gap: float | None = None  # seconds between faults, gap to 2 x gap (None: 5 s, on hosts 2 s)
    keep: Path | None = None
    settle: float = SETTLE_S
    clients: int = CLIENTS
    topology: str = "local"  # local | cluster | supercluster (on hosts of their own: `lab.torture.fleet`)


class TortureResult(msgspec.Struct, kw_only=True):
    seed: int
    duration_s: float
    topology: str
    faults_enabled: list[str]
    run_dir: str
    kept: bool
    operations: dict[str, dict[str, int]]
    refusals: dict[str, int]
    faults: dict[str, int]
    faults_on_reserve: int
    samples: int
    violations: list[Violation]
    ok: bool


async def _torture(
    fleet: TortureFleet, options: TortureOptions, history: HistoryWriter, progress: Callable[[str], None]
) -> None:
    workers = fleet.workers
    regions = sorted(set(workers.values()))
    on_hosts = fleet.topology != "local"
    sampler = Sampler(workers, fleet.marker, fleet.url, history)
    await sampler.open()
    stop_sampling = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop_sampling))
    try:
        t0 = time.time()
        history.write(
            Meta(
                seed=options.seed,
                duration_s=options.duration,
                faults=list(options.faults),
                started_at=t0,
                run_dir=str(history.path.parent),
                marker=fleet.marker,
                workers=workers,
                capacity=fleet.capacity,
                operator_app=OPERATOR_APP,
                operator_counts=fleet.operator_counts,
                client_apps=[f"torture-c{i}" for i in range(options.clients)],
                topology=fleet.topology,
                hosts=fleet.host_workers,
            )
        )
        schedule = fault_schedule(
            options.seed,
            options.duration,
            options.faults,
            list(workers),
            fleet.brokers,
            hosts=fleet.host_names,
            regions=list(fleet.regions) if fleet.topology == "supercluster" else [],
            servers=fleet.servers,
            operators=fleet.operators if on_hosts else [],
            gap=options.gap if options.gap is not None else (HOSTS_GAP if on_hosts else GAP_S),
        )
        nemesis = Nemesis(fleet, schedule, history, fleet.url, progress)
        stop_clients = asyncio.Event()
        clients = [
            Client(i, options.seed, regions, fleet.client_url(i), fleet.marker, history) for i in range(options.clients)
        ]
        client_tasks = [asyncio.create_task(c.run(stop_clients)) for c in clients]
        faulting = asyncio.create_task(nemesis.run(t0))
        progress(f"workload and nemesis running for {options.duration:g}s ({len(schedule)} faults scheduled)")
        await asyncio.sleep(options.duration)
        stop_clients.set()
        await faulting  # the last fault's recovery
        done, pending = await asyncio.wait(client_tasks, timeout=CLIENT_DRAIN_S)
        for task in pending:
            task.cancel()
        errors = [t.exception() for t in done if t.exception() is not None]
        if errors:
            raise TortureError(f"a client failed: {errors[0]!r}")
        restarted = fleet.ensure_up()
        if restarted:
            progress(f"restarted {', '.join(restarted)}")
        progress(f"faults over ({len(nemesis.faults)}); settling")
        sampler.phase = "settle"
        if not await _settle(fleet, sampler, 60.0, progress):
            progress("not every worker answered within 60s of the faults ending")
        await asyncio.sleep(max(options.settle, HOSTS_SETTLE_S) if on_hosts else options.settle)
        stop_sampling.set()
        await sampling
        await sampler.final()
        progress("final snapshot taken; probing the operator")
        probe = await sampler.probe(OPERATOR_APP, fleet.operator_counts)
        try:
            await sampler.events(OPERATOR_APP)
        except Exception as exc:  # the checks that need them say so; the others stand
            progress(f"could not read {OPERATOR_APP}'s events: {exc!r}")
        history.write(End(at=time.time(), note=f"probe restored: {probe.restored_at is not None}"))
    finally:
        stop_sampling.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(sampling, 5)
        await sampler.close()


async def _settle(fleet: TortureFleet, sampler: Sampler, timeout: float, progress: Callable[[str], None]) -> bool:
    """Until every worker answers (False at the deadline), starting again any process of the fleet that exited
    meanwhile, as its supervisor would (systemd's `Restart=on-failure`): a worker started while its JetStream did
    not answer gives up after 30 s, and it is the supervisor's to start it again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        restarted = fleet.ensure_up()
        if restarted:
            progress(f"restarted {', '.join(restarted)} (it had exited)")
        if await sampler.settled(min(5.0, max(0.5, deadline - time.monotonic()))):
            return True
    return False


def result_of(options: TortureOptions, run_dir: Path, kept: bool, verdict: Verdict) -> TortureResult:
    return TortureResult(
        seed=options.seed,
        duration_s=options.duration,
        topology=options.topology,
        faults_enabled=list(options.faults),
        run_dir=str(run_dir),
        kept=kept,
        operations=verdict.operations,
        refusals=verdict.refusals,
        faults=verdict.faults,
        faults_on_reserve=verdict.faults_on_reserve,
        samples=verdict.samples,
        violations=verdict.violations,
        ok=not verdict.violations,
    )


def run(options: TortureOptions, progress: Callable[[str], None] = lambda line: None) -> TortureResult:
    """Run and check; the run directory is removed afterwards unless kept, or the run found violations."""
    if options.keep is not None:
        options.keep.mkdir(parents=True, exist_ok=True)
        run_dir = options.keep.resolve()
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="fauxmad-torture-"))
    progress(f"run directory: {run_dir}")
    marker = f"{options.seed}-{os.getpid()}-{time.time_ns()}"
    history = HistoryWriter(run_dir / "history.jsonl")
    fleet = TortureFleet(run_dir / "fleet", marker, options.topology)
    finished = False
    try:
        fleet.start()
        progress(f"fleet up at {fleet.url}: workers {', '.join(fleet.workers)}, {len(fleet.brokers)} brokers, operator")
        if fleet.host_names:
            progress("hosts: " + "; ".join(f"{h}: {', '.join(w) or '-'}" for h, w in fleet.host_workers.items()))
        fleet.deploy_operator_app()
        progress(f"{OPERATOR_APP} deployed (a primary and a spare per region)")
        uvloop.run(_torture(fleet, options, history, progress))
        finished = True
    finally:
        with contextlib.suppress(Exception):
            fleet.stop()
        history.close()
        if not finished:
            progress(f"the run did not finish: kept {run_dir}")
    verdict = check(load(history.path))
    kept = options.keep is not None or bool(verdict.violations)
    if not kept:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result_of(options, run_dir, kept, verdict)


def render(result: TortureResult) -> str:
    """The plain report: seed, counts, and `0 violations` or each violation with its evidence."""
    lines = [
        f"seed {result.seed}, {result.duration_s:g}s, faults {','.join(result.faults_enabled) or 'none'}"
        + ("" if result.topology == "local" else f", on hosts ({result.topology})"),
        f"run directory: {result.run_dir}" + ("" if result.kept else " (removed)"),
        "operations:",
    ]
    for kind, outcomes in result.operations.items():
        parts = ", ".join(f"{outcome} {n}" for outcome, n in sorted(outcomes.items()))
        lines.append(f"  {kind:<8} {parts}")
    if result.refusals:
        lines.append("refused by code: " + ", ".join(f"{code} x{n}" for code, n in result.refusals.items()))
    faults = ", ".join(f"{kind} {n}" for kind, n in result.faults.items()) or "none"
    lines.append(f"faults: {faults} ({result.faults_on_reserve} struck as a reserve went out)")
    lines.append(f"samples: {result.samples}")
    if not result.violations:
        lines.append("0 violations")
    else:
        lines.append(f"{len(result.violations)} violation{'s' if len(result.violations) != 1 else ''}:")
        lines += [f"  [{v.check}] {v.message}" for v in result.violations]
    return "\n".join(lines) + "\n"
