"""`fauxmad bench placement --floor` and CPU per create: pure helpers, then a tiny real run.

The real run checks the report's shape and that the floors' numbers come from real responders: the
reserves they acknowledged are in their LMDB files and in their JetStream streams (the contract's floors:
also their index entries and audit records). No timing is asserted.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from lab.bench.cpu import CpuMeter, ms_per_op, parse_stat, ticks_between, tree_ticks
from lab.bench.floor_auction import pick
from lab.bench.floor_run import FloorOptions, report, run_floor, split
from lab.bench.placement import PlacementOptions
from lab.bench.report import plain
from orchestrator.cli.app import main
from tests.helpers import wait_until

# -- CPU accounting: pure -----------------------------------------------------------------------------


def test_parse_stat_reads_parent_utime_and_stime_even_with_parentheses_in_the_name() -> None:
    fields = ["S", "41", *["0"] * 9, "250", "17", *["0"] * 30]
    assert parse_stat(f"1234 (a (weird) name) {' '.join(fields)}") == (41, 250, 17)


def test_ticks_between_counts_each_rise_and_a_new_process_whole() -> None:
    before = {10: 100, 11: 50, 12: 7}
    after = {10: 130, 11: 50, 13: 20}  # 12 ended (lost), 13 is new
    assert ticks_between(before, after) == 30 + 0 + 20
    assert ms_per_op(30, 10, 100) == 30.0  # 30 ticks at 100 Hz = 300 ms over 10
    assert ms_per_op(30, 0, 100) is None


def test_split_spreads_the_count_over_rounds_without_empty_ones() -> None:
    assert split(10, 4) == [3, 3, 2, 2]
    assert split(3, 8) == [1, 1, 1]
    assert sum(split(2001, 4)) == 2001


def test_pick_takes_the_most_free_less_what_the_client_has_pending() -> None:
    offers: list[dict[str, object]] = [
        {"worker_id": "a", "free_cpus": 10},
        {"worker_id": "b", "free_cpus": 9},
    ]
    rng = random.Random(1)
    assert pick(offers, {}, rng) == "a"
    assert pick(offers, {"a": 2}, rng) == "b"
    assert pick([], {}, rng) is None


# -- CPU accounting: real processes -------------------------------------------------------------------


@pytest.mark.fleet  # starts processes of its own
def test_the_meter_counts_a_burning_descendant_and_not_an_idle_process() -> None:
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'while True: pass' & wait"])
    idle = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert idle.stdout is not None and idle.stdout.readline().strip() == b"ready"
        wait_until(lambda: len(tree_ticks([shell.pid])) == 2, "the shell's burning child")
        meter, other = CpuMeter([shell.pid]), CpuMeter([idle.pid])
        meter.start()
        other.start()

        def burnt() -> bool:
            meter.stop()  # stretches add up, as rounds do
            meter.start()
            return meter.ticks >= 10

        wait_until(burnt, "ten ticks of the shell's child", timeout=30)
        meter.stop()
        other.stop()
        assert meter.processes == 2  # the shell (root) and its child
        assert other.ticks <= 2  # an idle process costs next to nothing
        assert meter.use(5).ms_per_op == round(meter.ticks * 1000 / meter.hz / 5, 3)
    finally:
        for pid in tree_ticks([shell.pid]):
            if pid != shell.pid:
                subprocess.run(["kill", str(pid)], check=False)
        shell.wait(10)
        assert idle.stdin is not None
        idle.stdin.close()
        idle.wait(10)


# -- a tiny real run ------------------------------------------------------------------------------------


def test_a_tiny_floor_run_measures_every_side_with_real_responders(tmp_path: Path) -> None:
    placement = PlacementOptions(workers=2, concurrency=3, count=6, warmup=2, echo_count=5)
    result = run_floor(FloorOptions(placement=placement, rounds=2, data_dir=str(tmp_path)))

    assert [level.concurrency for level in result.levels] == [1, 3]
    for level in result.levels:
        assert set(level.floors) == {"contract", "contract+audit"}
        for side in (level.fauxmad, level.floor, *level.floors.values()):
            assert side.errors == 0 and side.refused == 0, side.first_error
            assert side.create.count == 6
            assert side.cpu.ops == 6 and side.cpu.ticks >= 0
        assert level.fauxmad.cpu.processes >= 4  # nats-server, 2 workers, a broker
        assert level.floor.cpu.processes >= 3  # nats-server, 2 responders
        assert all(side.cpu.processes >= 4 for side in level.floors.values())  # and the floor's broker
        assert level.latency_over_floor.p50 is not None
        assert set(level.over_floor) == set(level.fauxmad_over) == set(level.floors)
    # every reserve the floor acknowledged (2 levels x (6 + 2 warm-up)) is in its LMDB files and its stream
    assert result.floor_acknowledged == 16
    assert result.floor_stream_messages == 16
    stored = 0
    for path in sorted(tmp_path.iterdir()):
        env = lmdb.open(str(path), readonly=True, lock=False)
        with env.begin() as txn:
            stored += txn.stat()["entries"]
        env.close()
    assert stored == 16 and len(list(tmp_path.iterdir())) == 2
    # the contract's floors went through their brokers and wrote their parts: an event and an index entry a
    # reserve (each machine its own entry), and for contract+audit an audit record a reserve (sent after the reply)
    assert result.contract_acknowledged == {"contract": 16, "contract+audit": 16}
    assert result.contract_streams["contract"] == {"FAUXMAD_FLOOR_C": 16, "FAUXMAD_FLOOR_C_INDEX": 16}
    audited = result.contract_streams["contract+audit"]
    assert audited["FAUXMAD_FLOOR_A"] == 16 and audited["FAUXMAD_FLOOR_A_INDEX"] == 16
    assert audited["FAUXMAD_FLOOR_A_AUDIT"] == 16

    text = plain(report(result))
    assert "c=1 fauxmad" in text and "c=3 floor" in text and "c=3 floor contract+audit" in text
    assert "CPU per create" in text and "(the contract's parts)" in text and "(fauxmad's own code)" in text


@pytest.mark.parametrize("extra", [["--start"], ["--nats", "nats://127.0.0.1:4222"], ["--supercluster", "1"]])
def test_floor_refuses_what_it_does_not_measure_in_one_line(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "placement", "--floor", *extra, "--output", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--floor" in err and len(err.splitlines()) == 1, err
