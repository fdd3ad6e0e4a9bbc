"""The benchmark library: its statistics, its plain tables, its edges, and one tiny real placement run.

No timing is asserted anywhere: numbers belong in notes, not tests.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from lab.bench import peer
from lab.bench import worker_store as store_bench
from lab.bench.echo import EchoResponder
from lab.bench.placement import PlacementOptions, report, run_placement
from lab.bench.report import Report, Table, latency_table, plain, plain_table, times
from lab.bench.stats import Latency, percentile, ratio, ratios, summarize
from lab.cli.bench_cmd import show
from orchestrator.cli.app import main

# -- statistics ------------------------------------------------------------------------------------


def test_percentiles_are_nearest_rank_so_each_is_an_observed_value() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert percentile([], 50) == 0.0


def test_summarize_turns_seconds_into_milliseconds() -> None:
    lat = summarize([0.003, 0.001, 0.002, 0.010])
    assert lat == Latency(count=4, p50_ms=2.0, p90_ms=10.0, p99_ms=10.0, max_ms=10.0, mean_ms=4.0)
    assert summarize([]) == Latency(count=0, p50_ms=0.0, p90_ms=0.0, p99_ms=0.0, max_ms=0.0, mean_ms=0.0)


def test_ratios_have_none_where_the_denominator_is_not_positive() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(1.0, 3.0) == 0.33
    assert ratio(1.0, 0.0) is None
    a = summarize([0.002, 0.004])
    b = summarize([0.001, 0.001])
    assert ratios(a, b).p50 == 2.0 and ratios(a, b).p99 == 4.0
    assert ratios(a, summarize([])).p50 is None
    assert times(None) == "-" and times(2.0) == "2.00x"


# -- plain tables ----------------------------------------------------------------------------------


def test_plain_table_aligns_columns_and_never_cuts_a_long_cell() -> None:
    long = "a very long description of what was measured, " * 3
    table = Table(
        title="title",
        columns=("what", "n"),
        align="lr",
        rows=(("short", "1"), (long.strip(), "12345")),
    )
    lines = plain_table(table)
    assert lines[0] == "title"
    width = len(long.strip())
    assert lines[1] == "what".ljust(width) + "  " + "    n"
    assert lines[2] == "short".ljust(width) + "  " + "    1"
    assert lines[3] == long.strip() + "  12345"
    assert len(lines[3]) > 120
    assert all(line == line.rstrip() for line in lines)


def test_plain_report_has_no_box_drawing_and_separates_tables_and_notes() -> None:
    lat = summarize([0.001, 0.002])
    text = plain(
        Report(
            tables=(latency_table("one", [("x", lat)]), Table(columns=("k",), align="l", rows=(("v",),))),
            notes=("a note",),
        )
    )
    assert text == (
        "one\nwhat  n  p50 ms  p90 ms  p99 ms  max ms\nx     2    1.00    2.00    2.00    2.00\n\nk\nv\n\na note\n"
    )
    assert not set(text) & set("─│┃━┏┓┗┛╇┡")
    assert plain(Report()) == ""


def test_a_table_refuses_rows_or_alignment_that_do_not_fit_its_columns() -> None:
    with pytest.raises(ValueError, match="align"):
        Table(columns=("a", "b"), align="l")
    with pytest.raises(ValueError, match="align"):
        Table(columns=("a",), align="c")
    with pytest.raises(ValueError, match="cells"):
        Table(columns=("a", "b"), align="lr", rows=(("only one",),))


def test_the_cli_prints_plain_text_when_stdout_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    cell = "x" * 150
    show(Report(tables=(Table(title="t", columns=("what", "n"), align="lr", rows=((cell, "1"),)),), notes=("[b]",)))
    out = capsys.readouterr().out
    assert out == f"t\n{'what'.ljust(150)}  n\n{cell}  1\n\n[b]\n"


def test_proxy_against_shows_each_rounds_overhead_beside_the_pooled_one() -> None:
    from lab.bench.proxy import ProxyOptions
    from lab.bench.proxy_against import AgainstResult, Side, overhead, overhead_ratio
    from lab.bench.proxy_against import report as against_report

    # p50 2 ms less 1 ms; p99 (nearest rank of 4: the largest) 9 less 3
    assert overhead([0.001, 0.001, 0.002, 0.003], [0.002, 0.002, 0.003, 0.009]) == (1.0, 6.0)
    assert overhead_ratio(0.3, 0.2) == 1.5 and overhead_ratio(0.3, 0.0) == 0.0 and overhead_ratio(0.3, -0.1) == 0.0

    def side(name: str, p50s: list[float]) -> Side:
        return Side(name=name, p50_ms=0.4, p99_ms=1.0, overhead_p50_ms=0.25, overhead_p99_ms=0.8,
                    requests_per_second=9000.0, rounds_per_second=[8000.0, 10000.0], rounds_overhead_p50_ms=p50s,
                    rounds_overhead_p99_ms=[0.7, 0.9], proxy_cpu_us_per_request=100.0, errors=0)  # fmt: skip

    result = AgainstResult(
        options=ProxyOptions(), rev="abc1234", commit="abc1234" + "0" * 33, rounds=2, upstream="u",
        load_generator="wrk", direct_p50_ms=0.15, direct_p99_ms=0.3, rounds_direct_p50_ms=[0.14, 0.16],
        this=side("this tree", [0.22, 0.3]), other=side("abc1234", [0.2, 0.0]), overhead_p50_ratio=1.0,
        rounds_overhead_p50_ratio=[1.1, 0.0], throughput_ratio=1.0,
    )  # fmt: skip
    text = plain(against_report(result))
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert rows == [
        ["1", "0.140", "0.220", "0.200", "x1.10", "0.700", "0.700", "8,000", "8,000"],
        ["2", "0.160", "0.300", "0.000", "-", "0.900", "0.900", "10,000", "10,000"],
    ]
    assert "overhead p50 x1.00 (rounds x1.10 to x1.10)" in text  # a round without a ratio is left out


# -- edges -----------------------------------------------------------------------------------------


def test_bench_peer_without_ray_says_how_to_install_it_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(peer, "ray_available", lambda: False)
    assert main(["bench", "peer", "--output", "/nonexistent/never-written.json"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "pip install -e '.[peers]'" in err[0], err
    with pytest.raises(peer.PeerMissing, match=r"\.\[peers\]"):
        peer.run_peer(peer.PeerOptions(count=1))


def test_the_worker_store_measurements_run_on_a_real_store(tmp_path: Path) -> None:
    size_mb = store_bench.build_log(tmp_path / "lmdb", 2500, machines=100)
    assert size_mb > 0
    assert store_bench.open_and_scan(tmp_path / "lmdb") == 100
    serial, concurrent, per_batch = store_bench.commit_rates(tmp_path, serial=20, concurrent=200, writers=8)
    assert serial > 0 and concurrent > 0 and per_batch >= 1


def test_the_echo_responder_answers_from_another_process_and_goes_away(nats_url: str) -> None:
    with EchoResponder(nats_url) as echo:
        assert echo.proc is not None
        proc = echo.proc
        lat = asyncio.run(echo.measure(5, warmup=1))
    assert lat.count == 5
    assert proc.poll() is not None  # exited when its stdin closed


# -- a real fleet, tiny ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.fleet
def test_placement_bench_on_a_real_fleet() -> None:
    progress: list[str] = []
    options = PlacementOptions(workers=2, count=6, warmup=2, concurrency=2, echo_count=5)
    result = run_placement(options, progress.append)
    assert result.errors == 0 and result.refused == 0, result.first_error
    assert result.create.count == 6
    assert result.bus_rtt.count == 5
    assert result.create_p50_over_bus_rtt_p50 is not None
    assert any("stopping the fleet" in line for line in progress)
    text = plain(report(result))
    assert "create (reserve)" in text and "bus round trip" in text and "create p50 / bus round trip p50" in text


@pytest.mark.timeout(180)
@pytest.mark.fleet
def test_proxy_bench_on_a_real_fleet_and_proxy(tmp_path: Path) -> None:
    from lab.bench.proxy import ProxyOptions, report, run_proxy_bench

    result = run_proxy_bench(ProxyOptions(requests=50, concurrency=4, seconds=0.5, wakes=2))
    assert result.errors == 0
    assert result.direct.count == result.proxied.count == 50
    assert result.after_resume.count == result.after_start.count == 2
    assert result.tiny_after_resume is not None and result.tiny_after_resume.count == 2
    assert result.tiny_after_create is not None and result.tiny_after_create.count == 2
    if shutil.which("cc"):  # the compiled app's wakes, where the host can build it
        assert result.native_after_start is not None and result.native_after_create is not None
        assert result.native_after_start.count == result.native_after_create.count == 2
    assert result.requests_per_second > 0 and result.throughput.proxy_cpu_us_per_request > 0
    assert result.throughput.load_generator == ("wrk" if shutil.which("wrk") else "asyncio client")
    assert result.throughput.upstream == ("examples/echo/tiny.c" if shutil.which("cc") else "examples/echo/app.py")
    text = plain(report(result))
    assert "GET through the proxy" in text and "first byte, machine suspended" in text


@pytest.mark.timeout(180)
@pytest.mark.fleet
def test_secure_bench_measures_an_open_and_a_secure_fleet_side_by_side() -> None:
    from lab.bench.secure import SecureOptions, report, run_secure_bench

    progress: list[str] = []
    result = run_secure_bench(SecureOptions(creates=6, workers=1, warmup=1), progress.append)
    assert result.open_create.count == result.secure_create.count == 6
    assert any("one secure (mutual TLS)" in line for line in progress)
    text = plain(report(result))
    assert "secure (mTLS + nkeys + permissions)" in text and "security adds" in text
    assert os.environ.get("FAUXMAD_CREDS") is None  # the secure fleet put back the environment it changed


@pytest.mark.timeout(180)
@pytest.mark.fleet
def test_api_bench_on_a_real_fleet_and_api_process() -> None:
    from lab.bench.api import ApiOptions, report, run_api

    result = run_api(ApiOptions(creates=5, gets=40, concurrency=4), lambda line: None)
    assert result.http_create.count == result.nats_create.count == 5
    assert result.http_get.count == 40 and result.gets_per_second > 0
    assert "HTTP adds" in plain(report(result))
