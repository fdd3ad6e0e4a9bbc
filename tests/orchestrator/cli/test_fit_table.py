"""`FitTable` and the status tables at 80 columns, pure: rendered into a string console from the view that
test_view builds (9 workers, 18 machines of two apps, one with a long name), so a change of priority or of
layout is seen without a fleet. test_output_fits runs the same rules through the CLI on a real fleet."""

from __future__ import annotations

import io
import re
import time

from rich import box

from orchestrator.cli import render
from orchestrator.cli.render import FitTable
from orchestrator.cli.view_render import machines_table, regions_table, workers_table
from orchestrator.view.query import ViewReader
from tests.orchestrator.view.test_view import fleet_view


def shown(*tables: object, width: int) -> list[str]:
    console = render.CliConsole(file=io.StringIO(), width=width, soft_wrap=True, markup=False, highlight=False)
    for table in tables:
        console.print(table)
    return console.file.getvalue().splitlines()  # type: ignore[attr-defined]


def status_lines(width: int) -> tuple[list[str], list[str]]:
    db = fleet_view()
    snap = ViewReader(db).snapshot(time.time(), events=0)
    db.close()
    lines = shown(
        regions_table(snap.regions),
        workers_table(snap.workers, time.time()),
        machines_table(snap.machines),
        width=width,
    )
    return lines, [m.id for m in snap.machines]


def test_status_at_80_columns_is_a_table_at_most_3_lines_longer_than_at_200() -> None:
    narrow, ids = status_lines(80)
    broad, _ = status_lines(200)
    assert len(ids) == 18
    assert max(len(line) for line in narrow) <= 80, "\n".join(narrow)
    assert len(narrow) <= len(broad) + 3, "\n".join([*narrow, "----", *broad])
    for mid in ids:  # one line a machine, its id whole, with its app and worker
        (line,) = [line for line in narrow if mid in line]
        assert re.search(r"\b(web|api-with-a-long-name)\b", line) and re.search(r"\b\w{3}-w\d\b", line), line
    headers = [narrow[n - 1].split() for n in range(1, len(narrow)) if set(narrow[n].strip()) == {"─"}]
    assert {"id", "app", "region", "worker", "state"} <= set(headers[-1]), headers
    assert {"region", "worker", "status"} <= set(headers[1]), headers


def table(cut_first: tuple[str, ...] = ()) -> FitTable:
    made = FitTable(box=box.SIMPLE_HEAD, cut_first=cut_first)
    for column in ("id", "app", "state", "checks", "cmd"):
        made.add_column(column, no_wrap=column in ("id", "app"))
    for n in range(3):
        made.add_row(f"{n:014x}", "an-app", "started", "http:passing, tcp:passing", "python3 /a/long/path/app.py --x")
    return made


def test_the_least_important_column_is_cut_then_left_out_and_said() -> None:
    natural = shown(table(), width=200)
    assert any("python3 /a/long/path/app.py --x" in line for line in natural)
    cut = shown(table(("cmd",)), width=80)
    assert max(len(line) for line in cut) <= 80 and any("…" in line for line in cut), cut
    assert any("http:passing, tcp:passing" in line for line in cut), cut  # the checks kept whole: cmd gave way
    narrow = shown(table(("cmd",)), width=48)
    assert max(len(line) for line in narrow) <= 48, narrow
    assert "cmd" not in narrow[0].split() and any("left out at 48 columns: cmd" in line for line in narrow), narrow
    assert all(any(f"{n:014x}" in line for line in narrow) for n in range(3))


def test_wide_draws_every_column_whole() -> None:
    render.WIDE.on = True
    try:
        lines = shown(table(("cmd",)), width=40)
    finally:
        render.WIDE.on = False
    assert any("python3 /a/long/path/app.py --x" in line and "00000000000000" in line for line in lines), lines
