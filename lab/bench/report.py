"""What a benchmark shows, as data: titled tables of strings plus note lines, and their plain-text form.

The CLI draws a `Report` with rich on a terminal and writes `plain(report)` otherwise, so piped output
is whole (rich would cut columns at 80) and has no box drawing. Cells are already formatted text;
`align` says per column whether it reads left (`l`) or right (`r`, numbers).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

import msgspec

from lab.bench.stats import Latency


class Table(msgspec.Struct, frozen=True, kw_only=True):
    title: str = ""
    columns: tuple[str, ...]
    align: str  # one `l` or `r` per column
    rows: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.align) != len(self.columns) or set(self.align) - {"l", "r"}:
            raise ValueError(f"align {self.align!r} does not fit columns {self.columns}")
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"row {row} does not have {len(self.columns)} cells")


class Report(msgspec.Struct, frozen=True, kw_only=True):
    tables: tuple[Table, ...] = ()
    notes: tuple[str, ...] = ()  # lines after the tables


LATENCY_COLUMNS = ("what", "n", "p50 ms", "p90 ms", "p99 ms", "max ms")
LATENCY_ALIGN = "lrrrrr"


def latency_row(what: str, lat: Latency) -> tuple[str, ...]:
    return (what, str(lat.count), *(f"{v:.2f}" for v in (lat.p50_ms, lat.p90_ms, lat.p99_ms, lat.max_ms)))


def latency_table(title: str, rows: Sequence[tuple[str, Latency]]) -> Table:
    return Table(
        title=title,
        columns=LATENCY_COLUMNS,
        align=LATENCY_ALIGN,
        rows=tuple(latency_row(what, lat) for what, lat in rows),
    )


def times(value: float | None) -> str:
    """A ratio as `3.2x`; `-` when there is none."""
    return "-" if value is None else f"{value:.2f}x"


def host_info() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}


def plain_table(table: Table) -> list[str]:
    """The table as aligned lines: columns two spaces apart, no trailing spaces, nothing cut."""
    widths = [max([len(col), *(len(row[i]) for row in table.rows)]) for i, col in enumerate(table.columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if side == "r" else cell.ljust(width)
            for cell, width, side in zip(cells, widths, table.align, strict=True)
        ]
        return "  ".join(parts).rstrip()

    lines = [table.title] if table.title else []
    lines.append(line(table.columns))
    lines.extend(line(row) for row in table.rows)
    return lines


def plain(report: Report) -> str:
    """The whole report as text: each table, a blank line between tables, then the notes."""
    blocks = ["\n".join(plain_table(table)) for table in report.tables]
    if report.notes:
        blocks.append("\n".join(report.notes))
    return "\n\n".join(blocks) + "\n" if blocks else ""
