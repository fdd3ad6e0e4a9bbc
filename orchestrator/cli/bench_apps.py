"""`fauxmad bench deploy|failover`: how long the reconcilers take on a real local fleet.

Each starts its own fleet (NATS, worker processes per region, a broker), so hosts can be killed.
`deploy` times a first deploy and a rolling update of N machines per region with http checks;
`failover` kills a host (its worker and its machine processes at once) while the operator runs,
and times until the spare of each lost primary is started.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from bus import subjects
from bus.messages import ListRequest, Machine
from bus.service import call
from orchestrator.apps.reconciler import Reconciler
from orchestrator.apps.spec import AppSpec, parse_spec
from orchestrator.benchstats import summarize
from orchestrator.cli.render import console
from orchestrator.cli.runtime import fail, run
from orchestrator.devfleet import DevFleet, FleetSpec

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "sandwich" / "app.py"


def bench_spec(
    app: str,
    regions: list[str],
    per_region: int,
    *,
    version: str,
    strategy: str = "rolling",
    max_unavailable: str = "0.33",
    spares: int = 0,
) -> AppSpec:
    counts = "\n".join(f"{r} = {per_region}" for r in regions)
    return parse_spec(f"""
app = "{app}"
cmd = {json.dumps([sys.executable, str(EXAMPLE)])}
env = {{ VERSION = "{version}" }}
[guest]
cpus = 1
memory_mb = 64
[regions]
{counts}
[checks.http]
type = "http"
path = "/health"
interval = "500ms"
timeout = "1s"
[deploy]
strategy = "{strategy}"
max_unavailable = {max_unavailable}
spares = {spares}
wait_timeout = "30s"
""")


def _regions(value: str) -> list[str]:
    names = [r.strip() for r in value.split(",") if r.strip()]
    if not names:
        fail("--regions needs at least one region")
    return names


def _fleet(regions: list[str], workers: int, cpus: int) -> DevFleet:
    root = tempfile.mkdtemp(prefix="fauxmad-bench-")
    spec = FleetSpec(regions=regions, workers_per_region=workers, cpus=cpus, memory_mb=cpus * 512, data_dir=root)
    return DevFleet(spec, progress=lambda line: console.print(f"[dim]{line}[/]"))


def _write(out: Path, result: dict[str, Any]) -> None:
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")


def deploy(
    regions: str = typer.Option("mad,syd,gru", "--regions", help="comma-separated regions"),
    machines: int = typer.Option(10, "--machines", min=1, max=200, help="machines per region"),
    workers: int = typer.Option(4, "--workers-per-region", min=1, max=20),
    strategy: str = typer.Option("rolling", "--strategy", help="rolling, canary, bluegreen or immediate"),
    max_unavailable: str = typer.Option("0.33", "--max-unavailable", help="a fraction or a count"),
    out: Path = typer.Option(Path("bench-deploy.json"), "--out", help="where to write the JSON result"),
) -> None:
    """Time a first deploy and a new release (every machine updated) across regions, with http checks."""
    names = _regions(regions)
    if strategy not in ("rolling", "canary", "bluegreen", "immediate"):
        fail(f"unknown --strategy {strategy!r}: use rolling, canary, bluegreen or immediate")
    cpus = max(2, -(-machines * (2 if strategy == "bluegreen" else 1) // workers) + 1)
    with _fleet(names, workers, cpus) as fleet:

        async def go() -> dict[str, Any]:
            reconciler = await Reconciler.connect(fleet.url)
            try:
                phases: dict[str, Any] = {}
                for phase, version, strat in (("create", "v1", "rolling"), ("update", "v2", strategy)):
                    spec = bench_spec(
                        "bench", names, machines, version=version, strategy=strat, max_unavailable=max_unavailable
                    )
                    started = time.perf_counter()
                    outcome = await reconciler.deploy(spec)
                    took = time.perf_counter() - started
                    if not outcome.ok:
                        fail(f"{phase}: {outcome.message}")
                    phases[phase] = {"seconds": round(took, 3), "release": outcome.release.version}
                    console.print(f"{phase}: {len(names) * machines} machines, {strat}: {took:.2f}s")
                await reconciler.destroy_app("bench")
                return phases
            finally:
                await reconciler.close()

        phases = run(go())
    console.print(f"deploy: {len(names)} regions x {machines} machines, {strategy}, http checks")
    table = Table(header_style="bold")
    for col in ("phase", "seconds"):
        table.add_column(col)
    for phase, row in phases.items():
        table.add_row(phase, f"{row['seconds']:.2f}")
    console.print(table)
    _write(
        out,
        {
            "regions": names,
            "machines_per_region": machines,
            "workers_per_region": workers,
            "strategy": strategy,
            "max_unavailable": max_unavailable,
            "phases": phases,
        },
    )


async def _spare_started(nc: Any, worker_id: str, machine_id: str) -> bool:
    found = await call(
        nc, subjects.worker_machines(worker_id, "list"), ListRequest(app="bench"), list[Machine], timeout=2
    )
    return any(m.id == machine_id and m.state == "started" for m in found)


def failover(
    rounds: int = typer.Option(3, "--rounds", min=1, max=50, help="hosts to kill, one after another"),
    workers: int = typer.Option(3, "--workers-per-region", min=2, max=20),
    machines: int = typer.Option(2, "--machines", min=1, max=50, help="primaries (each with one spare)"),
    out: Path = typer.Option(Path("bench-failover.json"), "--out", help="where to write the JSON result"),
) -> None:
    """Kill a host while `reconcile --watch` runs; time until its primaries' spares are started."""
    with _fleet(["mad"], workers, max(2, machines)) as fleet:

        async def go() -> list[float]:
            operator = await Reconciler.connect(fleet.url)
            stop = asyncio.Event()
            try:
                outcome = await operator.deploy(bench_spec("bench", ["mad"], machines, version="v1", spares=1))
                if not outcome.ok:
                    fail(outcome.message)
                watching = asyncio.create_task(operator.watch(["bench"], stop))
                samples = []
                for round_ in range(rounds):
                    samples.append(await _one_failover(fleet, operator, round_))
                stop.set()
                await watching
                return samples
            finally:
                await operator.close()

        samples = run(go())
    lat = summarize(samples)
    console.print(
        f"host death -> spare started, {rounds} rounds: p50 {lat.p50_ms / 1000:.2f}s, "
        f"max {lat.max_ms / 1000:.2f}s (heartbeat 1s, worker TTL 3s)"
    )
    _write(
        out,
        {
            "rounds": rounds,
            "seconds": [round(s, 3) for s in samples],
            "p50_s": lat.p50_ms / 1000,
            "max_s": lat.max_ms / 1000,
        },
    )


async def _one_failover(fleet: DevFleet, operator: Reconciler, round_: int) -> float:
    deadline = time.perf_counter() + 60
    while True:  # a settled app: every primary healthy with its spare
        found = await operator.observer.observe("bench", ["mad"])
        ps = [m for m in found.machines if m.role == "primary" and m.state == "started" and m.healthy]
        spares = {m.standby_of: m for m in found.machines if m.role == "spare" and m.state in ("created", "stopped")}
        if ps and all(p.id in spares for p in ps) and not found.lost:
            break
        if time.perf_counter() > deadline:
            fail(f"round {round_ + 1}: the app did not settle")
        await asyncio.sleep(0.2)
    victim = ps[0]
    standby = spares[victim.id]
    fleet.kill_host(victim.worker_id)
    killed = time.perf_counter()
    while not await _spare_started(operator.nc, standby.worker_id, standby.id):
        if time.perf_counter() - killed > 30:
            fail(f"round {round_ + 1}: the spare {standby.id} did not start within 30s")
        await asyncio.sleep(0.02)
    took = time.perf_counter() - killed
    console.print(f"round {round_ + 1}: killed {victim.worker_id}; spare {standby.id} started after {took:.2f}s")
    fleet.respawn(f"worker-{victim.worker_id}")
    return took
