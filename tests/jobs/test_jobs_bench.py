"""`fauxmad bench jobs` runs end to end on a tiny load (numbers belong in notes, not tests); the baselines
run when redis-server and the `jobs-bench` extra are here, and are skipped with one line otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lab.bench import jobs as bench
from orchestrator.cli.app import main

pytestmark = pytest.mark.fleet  # starts a fleet of real processes (tests/conftest.py)


def test_bench_jobs_measures_fauxmad_and_says_why_baselines_were_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench-jobs.json"
    code = main(
        [
            "bench",
            "jobs",
            "--tasks",
            "40",
            "--samples",
            "5",
            "--workers",
            "2",
            "--slots",
            "2",
            "--no-baselines",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    (system,) = result["systems"]
    assert system["system"] == "fauxmad (process)" and system["tasks"] == 40 and system["tasks_per_s"] > 0
    assert system["free_running"]["count"] == 5
    assert result["skipped"] == ["baselines not asked for (--no-baselines)"]
    captured = capsys.readouterr()
    assert "tasks/s" in captured.out and "note: baselines not asked for" in captured.err


def test_the_baselines_are_skipped_with_one_line_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    why = bench.missing_baselines()
    assert why is not None and why.startswith("redis-server not found") and "\n" not in why


@pytest.mark.skipif(bench.missing_baselines() is not None, reason=str(bench.missing_baselines()))
def test_the_baselines_do_the_same_work(tmp_path: Path) -> None:
    options = bench.JobsBenchOptions(tasks=30, samples=3, workers=1, slots=2)
    results = bench.measure_baselines(options, lambda line: None)
    assert [r.system for r in results] == ["redis BLPOP", "arq"]
    assert all(r.tasks == 30 and r.free_taken.count == 3 for r in results)
