"""`fauxmad bench placement --against REV`: a bad revision is one line and exit 2; HEAD builds and runs both sides.

The HEAD run is real: a git worktree of HEAD pip-installed into a virtualenv (in a cache of the test's own),
then tiny alternating runs of this tree's bench and HEAD's, each with a fleet of its own. No timing asserted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from lab.bench.against import (
    CACHE_ENV,
    ROOT,
    AgainstResult,
    RunFigures,
    bench_args,
    build,
    level,
    report,
    resolve,
    side,
)
from lab.bench.placement import PlacementOptions
from lab.bench.report import plain
from orchestrator.cli.app import main


def test_sides_are_the_median_of_their_rounds_and_ratios_are_this_over_rev() -> None:
    ours = [RunFigures(p50_ms=p, p99_ms=2 * p, throughput_per_s=100 / p, errors=0, refused=0) for p in (3.0, 5.0, 4.0)]
    theirs = [RunFigures(p50_ms=2.0, p99_ms=4.0, throughput_per_s=50.0, errors=0, refused=0)]
    assert side(ours).p50_ms == 4.0 and side(ours).p99_ms == 8.0 and side(ours).throughput_per_s == 25.0
    lv = level(64, ours, theirs)
    assert (lv.p50_ratio, lv.p99_ratio, lv.throughput_ratio) == (2.0, 2.0, 0.5)


@pytest.mark.fleet  # starts processes of its own
def test_bench_args_use_only_options_the_first_wave_knew() -> None:
    first_wave = subprocess.run(
        ["git", "-C", str(ROOT), "show", "5db8189:orchestrator/cli/bench_cmd.py"], capture_output=True, text=True
    )
    if first_wave.returncode != 0:
        pytest.skip("this clone does not hold the first wave's commit")
    args = bench_args(PlacementOptions(workers_per_process=2, start=True), 64, 500, Path("/tmp/x.json"))
    for option in (a for a in args[2:] if a.startswith("--")):
        assert f'"{option}"' in first_wave.stdout, option


@pytest.mark.fleet  # starts processes of its own
def test_a_bad_revision_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for rev in ("no-such-revision-anywhere", "-x", "0" * 40):
        assert main(["bench", "placement", "--against", rev, "--output", "/nonexistent/x.json"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--against" in err and "Traceback" not in err, err
    assert (
        resolve("HEAD")
        == subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )


@pytest.mark.fleet  # starts processes of its own
def test_against_head_builds_it_and_runs_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    argv = ["bench", "placement", "--against", "HEAD", "--workers", "1", "-c", "2", "-n", "3", "--warmup", "1"]
    argv += ["--rounds", "1", "--echo-count", "1", "--json", "--output", str(tmp_path / "out.json")]
    before = resolve("HEAD")
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    head = result["rev_commit"]  # HEAD then (others may commit meanwhile)
    assert result["rev"] == "HEAD" and _since(before, head)
    assert _since(head, result["this_commit"].removesuffix("+changes"))
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    for lv in result["levels"]:
        for name in ("this", "rev"):
            (run,) = lv[name]["runs"]
            assert run["errors"] == 0 and run["refused"] == 0
            assert run["p50_ms"] > 0 and run["throughput_per_s"] > 0
        assert lv["p50_ratio"] is not None and lv["throughput_ratio"] is not None
    assert (tmp_path / "cache" / head / "built").exists()  # kept: the next run starts at once
    assert "pip install" in captured.err and "worktree" in captured.err  # progress while it builds
    worktrees = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert "fauxmad-against-" not in worktrees  # the temporary worktree is gone

    said: list[str] = []
    build("HEAD", head, tmp_path / "cache", said.append)  # a second run uses the build
    assert len(said) == 1 and "using its build" in said[0]

    text = plain(report(msgspec.convert(result, AgainstResult)))
    assert "c=2 this tree" in text and "c=1 HEAD" in text and "throughput" in text


def _since(old: str, new: str) -> bool:
    """`new` is `old` or a commit after it."""
    done = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", old, new], check=False)
    return done.returncode == 0
