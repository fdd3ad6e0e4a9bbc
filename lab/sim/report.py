"""The simulator's report: the comparison table and the balls-into-bins lines (bench's report format), and
PNG plots when matplotlib (the optional `plots` extra) is installed."""

from __future__ import annotations

from pathlib import Path

from lab.bench.report import Report, Table
from lab.sim.run import SimReport

COLUMNS = (
    "strategy",
    "placed",
    "failed",
    "with room",
    "widened",
    "mean util",
    "p99",
    "max",
    "stdev",
    "hot",
    "µs/place",
)


def report(sim: SimReport) -> Report:
    rows = tuple(
        (
            r.strategy,
            f"{r.placed:,}",
            f"{r.failed:,}",
            f"{r.refused_with_room:,}",
            f"{r.widened:,}",
            f"{r.at_peak.mean:.3f}",
            f"{r.at_peak.p99:.3f}",
            f"{r.at_peak.max:.3f}",
            f"{r.at_peak.stdev:.3f}",
            f"{r.at_peak.hot:,}",
            f"{r.placement_us:.1f}",
        )
        for r in sim.results
    )
    title = (
        f"{sim.machines:,} machines on {sim.workers:,} workers (regions of {sim.region_size}), seed {sim.seed}; "
        "cpu utilization at the fullest sample; hot = workers at >= 90%; with room = refused though a worker of the "
        "region had room (an omniscient placer would have placed it); widened = p2c samples that could not take it, "
        "placed by a scatter"
    )
    notes = []
    if sim.balls is not None:
        b = sim.balls
        notes.append(
            f"balls into bins, n = {b.n:,}: max load d=1 {b.max_load_d1} (ln n/ln ln n = {b.theory_d1}), "
            f"d=2 {b.max_load_d2} (ln ln n/ln 2 = {b.theory_d2}), d=3 {b.max_load_d3}"
        )
    notes.append(f"simulated in {sim.seconds:.1f} s")
    return Report(tables=(Table(title=title, columns=COLUMNS, align="lrrrrrrrrrr", rows=rows),), notes=tuple(notes))


def plot(sim: SimReport, directory: Path) -> list[Path]:
    """Bar charts of the table's key columns (matplotlib; `ImportError` without the `plots` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    names = [r.strategy for r in sim.results]
    written = []
    for title, values, filename in (
        ("workers at >= 90% cpu (hot spots)", [r.at_peak.hot for r in sim.results], "sim-hot.png"),
        ("stdev of cpu utilization", [r.at_peak.stdev for r in sim.results], "sim-stdev.png"),
        ("failed placements", [r.failed for r in sim.results], "sim-failed.png"),
        ("µs per placement decision", [r.placement_us for r in sim.results], "sim-cost.png"),
    ):
        figure, axes = plt.subplots(figsize=(7, 3.5))
        axes.bar(names, values)
        axes.set_title(title)
        figure.tight_layout()
        path = directory / filename
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
