"""`fauxmad sim`: parse the options, run `lab.sim`, show the table, write JSON (and plots)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import typer

from orchestrator.cli.runtime import EXIT_USAGE, fail


def sim(
    workers: int = typer.Option(10_000, "--workers", min=2, max=1_000_000, help="simulated workers"),
    machines: int = typer.Option(100_000, "--machines", min=1, max=10_000_000, help="machines in the trace"),
    region_size: int = typer.Option(50, "--region-size", min=2, help="workers per region (an auction's reach)"),
    strategies: str = typer.Option(
        "scatter,p2c-2,p2c-3,binpack,spread,random,omniscient", "--strategies", help="comma-separated"
    ),
    balls: int = typer.Option(10_000, "--balls", min=0, help="balls-into-bins size (0: skip)"),
    seed: int = typer.Option(1, "--seed", help="the trace's and the draws' seed"),
    quick: bool = typer.Option(False, "--quick", help="a small run: 1,000 workers, 10,000 machines"),
    jobs: int = typer.Option(0, "--jobs", "-j", min=0, help="strategies simulated at once [default: one per cpu]"),
    output: Path = typer.Option(Path("sim.json"), "--output", "-o", help="where to write the JSON"),
    plots: Path | None = typer.Option(None, "--plots", help="a directory for PNG plots (needs the `plots` extra)"),
    json_out: bool = typer.Option(False, "--json", help="print the JSON result instead of the table"),
) -> None:
    """Compare placement strategies with the real placement chain over a simulated fleet (no NATS).

    Every strategy places the same seeded trace (arrivals, lifetimes, mixed guest sizes); the table shows
    failures (and those an omniscient placer would not have had), utilization spread, hot spots and the
    cost of a decision; then p2c against the balls-into-bins result.
    """
    from lab.cli.bench_cmd import _finish, _progress
    from lab.sim.placers import STRATEGIES
    from lab.sim.report import plot, report
    from lab.sim.run import run

    chosen = [s.strip() for s in strategies.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STRATEGIES and not re.fullmatch(r"p2c-\d+(-strict)?", s)]
    if not chosen or unknown:
        fail(f"unknown strategy {', '.join(unknown) or '(none given)'}: use {', '.join(STRATEGIES)}", EXIT_USAGE)
    if quick:
        workers, machines, balls = min(workers, 1000), min(machines, 10_000), min(balls, 10_000)
    if region_size > workers:
        fail(f"--region-size {region_size} is more than --workers {workers}", EXIT_USAGE)
    if plots is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plots needs matplotlib: pip install 'fauxmad[plots]'", EXIT_USAGE)
    result = run(
        workers=workers,
        machines=machines,
        region_size=region_size,
        seed=seed,
        strategies=chosen,
        balls=balls or None,
        jobs=jobs or os.cpu_count() or 1,
        progress=_progress,
    )
    _finish(result, report(result), output, json_out)
    if plots is not None:
        for path in plot(result, plots):
            print(f"wrote {path}")
