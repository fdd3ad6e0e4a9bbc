"""Deploys, timed: a first deploy and a new release (every machine updated) on a real local fleet.

Its own fleet (NATS, worker processes per region, a broker), the sample app (`examples/sandwich`)
with an http check, so each phase ends only when every machine is started and passing.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import uvloop

from lab.bench import BenchError
from lab.bench.report import Report, Table
from orchestrator.apps.spec import AppSpec, parse_spec
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.reconcile import rollout
from orchestrator.reconcile.destroy import destroy_app
from orchestrator.reconcile.reconciler import Reconciler

EXAMPLE = Path(__file__).resolve().parent.parent.parent / "examples" / "sandwich" / "app.py"
APP = "bench"
STRATEGIES = ("rolling", "canary", "bluegreen", "immediate")


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


def bench_fleet(regions: list[str], workers: int, cpus: int, progress: Callable[[str], None]) -> DevFleet:
    root = tempfile.mkdtemp(prefix="fauxmad-bench-")
    spec = FleetSpec(regions=regions, workers_per_region=workers, cpus=cpus, memory_mb=cpus * 512, data_dir=root)
    return DevFleet(spec, progress=progress)


class DeployOptions(msgspec.Struct, frozen=True, kw_only=True):
    regions: list[str] = msgspec.field(default_factory=lambda: ["mad", "syd", "gru"])
    machines: int = 10  # per region
    workers: int = 4  # per region
    strategy: str = "rolling"  # of the update; the first deploy is rolling
    max_unavailable: str = "0.33"


class Phase(msgspec.Struct, kw_only=True):
    seconds: float
    release: int


class DeployResult(msgspec.Struct, kw_only=True):
    regions: list[str]
    machines_per_region: int
    workers_per_region: int
    strategy: str
    max_unavailable: str
    phases: dict[str, Phase]


def run_deploy(options: DeployOptions, progress: Callable[[str], None] = lambda line: None) -> DeployResult:
    if options.strategy not in STRATEGIES:
        raise BenchError(f"unknown strategy {options.strategy!r}: use {', '.join(STRATEGIES)}")
    names, machines = options.regions, options.machines
    per_machine = 2 if options.strategy == "bluegreen" else 1  # old and new side by side
    cpus = max(2, -(-machines * per_machine // options.workers) + 1)

    async def phases(url: str) -> dict[str, Phase]:
        reconciler = await Reconciler.connect(url)
        try:
            done: dict[str, Phase] = {}
            for phase, version, strategy in (("create", "v1", "rolling"), ("update", "v2", options.strategy)):
                spec = bench_spec(
                    APP, names, machines, version=version, strategy=strategy, max_unavailable=options.max_unavailable
                )
                began = time.perf_counter()
                outcome = await rollout.deploy(reconciler, spec)
                took = time.perf_counter() - began
                if not outcome.ok:
                    raise BenchError(f"{phase}: {outcome.message}")
                done[phase] = Phase(seconds=round(took, 3), release=outcome.release.version)
                progress(f"{phase}: {len(names) * machines} machines, {strategy}: {took:.2f}s")
            await destroy_app(reconciler, APP)
            return done
        finally:
            await reconciler.close()

    with bench_fleet(names, options.workers, cpus, progress) as fleet:
        done = uvloop.run(phases(fleet.url))
    return DeployResult(
        regions=names,
        machines_per_region=machines,
        workers_per_region=options.workers,
        strategy=options.strategy,
        max_unavailable=options.max_unavailable,
        phases=done,
    )


def report(result: DeployResult) -> Report:
    title = (
        f"deploy: {len(result.regions)} regions x {result.machines_per_region} machines, {result.strategy}, http checks"
    )
    rows = tuple((phase, f"{p.seconds:.2f}", f"v{p.release}") for phase, p in result.phases.items())
    return Report(tables=(Table(title=title, columns=("phase", "seconds", "release"), align="lrr", rows=rows),))
