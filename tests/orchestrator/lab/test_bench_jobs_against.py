"""`fauxmad bench jobs --against REV`: REV's command line uses only options ddae660 knew, a side is the median
of its rounds, a bad revision is one line and exit 2. The full run is the placement one's (test_bench_against):
the same build and the same alternation; no timing asserted."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lab.bench import BenchError
from lab.bench.against import ROOT
from lab.bench.jobs import JobsBenchOptions
from lab.bench.jobs_against import JobsFigures, bench_args, figures, side
from orchestrator.cli.app import main

ISSUE_43_BASE = "ddae660"  # the commit issue 43 was filed against: `bench jobs --against` must reach back to it


def test_bench_args_use_only_options_ddae660_knew() -> None:
    then = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ISSUE_43_BASE}:orchestrator/cli/bench_cmd.py"],
        capture_output=True,
        text=True,
    )
    if then.returncode != 0:
        pytest.skip(f"this clone does not hold {ISSUE_43_BASE}")
    args = bench_args(JobsBenchOptions(nats_sync=False, runner="machine"), Path("/tmp/x.json"))
    assert args[:2] == ["bench", "jobs"] and "--no-baselines" in args
    for option in (a for a in args[2:] if a.startswith("--")):
        assert option in then.stdout, option


def test_figures_are_fauxmads_and_a_side_is_the_median_of_its_rounds() -> None:
    latency = {"p50_ms": 2.0, "p99_ms": 9.0}
    run = {"systems": [{"tasks_per_s": 800.0, "free_running": latency, "burst_taken": {"p50_ms": 300.0}}]}
    assert figures(run, "x") == JobsFigures(
        tasks_per_s=800.0, free_running_p50_ms=2.0, free_running_p99_ms=9.0, burst_taken_p50_ms=300.0
    )
    rounds = [JobsFigures(tasks_per_s=t, free_running_p50_ms=t / 100, free_running_p99_ms=1.0, burst_taken_p50_ms=1.0)
              for t in (700.0, 900.0, 800.0)]  # fmt: skip
    assert side(rounds).median.tasks_per_s == 800.0 and side(rounds).median.free_running_p50_ms == 8.0


def test_a_run_without_a_jobs_result_is_named() -> None:
    with pytest.raises(BenchError, match="ddae660's bench wrote no jobs result"):
        figures({"systems": []}, "ddae660")


def test_a_bad_revision_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for rev in ("no-such-revision-anywhere", "-x"):
        assert main(["bench", "jobs", "--against", rev, "--output", "/nonexistent/x.json"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--against" in err and "Traceback" not in err, err
