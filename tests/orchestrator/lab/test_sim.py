"""The simulator: the real placement chain over an in-memory fleet. What is checked are properties of the
policies (seeded, so exact), never timings: p2c's balls-into-bins result, the omniscient placer as the
floor of refusals, spread spreading and binpack packing, determinism, and the command's edges."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lab.sim.run import balls_into_bins, run
from tests.helpers import ROOT


def test_two_choices_bring_the_max_load_down_to_log_log_n() -> None:
    n = 10_000
    result = balls_into_bins(n, seed=7)
    # d = 2: ln ln n / ln 2 + O(1) (3.2 + a small constant); d = 1: ln n / ln ln n asymptotically, larger
    # at this n (about 6-7); d = 3 no worse than d = 2
    assert result.max_load_d2 <= math.log(math.log(n)) / math.log(2) + 2
    assert result.max_load_d1 >= result.max_load_d2 + 2
    assert result.max_load_d3 <= result.max_load_d2


def test_the_strategies_compare_as_their_policies_say() -> None:
    strategies = ["omniscient", "scatter", "p2c-2", "p2c-2-strict", "binpack", "spread", "random"]
    report = run(workers=400, machines=6_000, region_size=40, seed=3, strategies=strategies, balls=None)
    by = {r.strategy: r for r in report.results}
    assert [r.strategy for r in report.results] == strategies
    # whoever sees the whole region never refuses while it has room; p2c sees two workers and sometimes does
    assert all(by[s].refused_with_room == 0 for s in ("omniscient", "scatter", "binpack", "spread", "random", "p2c-2"))
    # without the broker's scatter behind it, p2c refuses creates its region had room for
    strict = by["p2c-2-strict"]
    assert strict.refused_with_room > 0 and strict.refused_with_room <= strict.failed
    assert by["p2c-2"].widened >= strict.refused_with_room and strict.widened == 0
    assert by["binpack"].at_peak.stdev > by["spread"].at_peak.stdev  # packing piles up, spreading evens out
    assert by["binpack"].at_peak.hot > by["spread"].at_peak.hot
    again = run(workers=400, machines=6_000, region_size=40, seed=3, strategies=["p2c-2"], balls=None)
    assert again.results[0].failed == by["p2c-2"].failed and again.results[0].at_peak == by["p2c-2"].at_peak


def fauxmad(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"},
        timeout=300,
    )


def test_the_command_writes_json_and_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    done = fauxmad(
        "sim", "--quick", "--workers", "200", "--machines", "2000", "--strategies", "scatter,p2c-2,omniscient",
        "--balls", "1000", "-o", str(tmp_path / "sim.json"), cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "p2c-2" in done.stdout and "balls into bins" in done.stdout
    written = json.loads((tmp_path / "sim.json").read_text())
    assert [r["strategy"] for r in written["results"]] == ["scatter", "p2c-2", "omniscient"]
    assert written["balls"]["n"] == 1000
    bad = fauxmad("sim", "--quick", "--strategies", "magic", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "unknown strategy magic" in bad.stderr
    too_big = fauxmad("sim", "--workers", "10", "--region-size", "50", cwd=tmp_path)
    assert too_big.returncode == 2 and "--region-size" in too_big.stderr


def test_plots_without_matplotlib_say_how_to_get_it(tmp_path: Path) -> None:
    pytest.importorskip("orchestrator")
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed here: the plots extra is present")
    except ImportError:
        pass
    done = fauxmad("sim", "--quick", "--plots", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2 and "fauxmad[plots]" in done.stderr and "Traceback" not in done.stderr
