"""`fauxmad bench placement --against-workers N`: two fleet sizes in one run, rounds alternating.

A tiny real run (a fleet of 2 workers, one process each, and one of 20 logical workers, three a process),
and the options it refuses, in one line. No timing asserted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from lab.bench.report import plain
from lab.bench.sizes import SizesResult, report
from orchestrator.cli.app import main


@pytest.mark.fleet  # starts fleets of its own
def test_two_sizes_in_one_run_alternate_rounds_each_on_its_own_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "placement", "--strategy", "p2c", "--workers", "2", "--against-workers", "20", "-n", "6"]
    argv += ["--warmup", "2", "--rounds", "2", "--json", "--output", str(tmp_path / "out.json")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert json.loads((tmp_path / "out.json").read_text()) == result
    assert result["strategy"] == "p2c" and result["rounds"] == 2
    this, other = result["this"], result["other"]
    assert (this["workers_per_region"], other["workers_per_region"]) == (2, 20)
    assert (this["workers_per_process"], other["workers_per_process"]) == (1, 3)  # 20 simulated: 7 processes
    for side in (this, other):
        assert side["errors"] == 0 and side["refused"] == 0, side["first_error"]
        assert side["create"]["count"] == 6  # every round's samples pooled: 3 + 3
        assert len(side["rounds"]) == 2
        assert all(r["p50_ms"] > 0 and r["fleet_start_s"] > 0 for r in side["rounds"])
    assert result["p99_ratio"] is not None and result["throughput_ratio"] is not None
    # the rounds alternate, A B then B A, and each starts a fleet of its own
    order = re.findall(r"round (\d) of 2: (\d+) workers", captured.err)
    assert order == [("1", "2"), ("1", "20"), ("2", "20"), ("2", "2")], captured.err
    assert captured.err.count("its fleet started in") == 4

    text = plain(report(msgspec.convert(result, SizesResult)))
    assert "2 workers / 20 workers: p99" in text and "20 workers, 3 a process" in text


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--floor"], "--against-workers"),
        (["--against", "HEAD"], "--against-workers"),
        (["--nats", "nats://127.0.0.1:4222"], "--against-workers"),
        (["--supercluster", "1"], "--against-workers"),
        (["--workers", "7", "--against-workers", "7"], "is the size --workers gives"),
    ],
)
def test_against_workers_refuses_what_it_cannot_measure_in_one_line(
    extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "placement", "--against-workers", "1000", *extra, "--output", "/nonexistent/x.json"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
