"""Rendering for people (rich tables) and for programs (`--json`): one place for both.

One rule for text a user or a machine wrote (names, commands, metadata, env values, reasons, log lines,
messages echoed back): it is printed as written, never obeyed. The CLI's console reads no markup, no
emoji codes and highlights nothing, so a `[/x]` or `:smile:` in a command is shown as typed (rich would
read it as a style, drop it, or raise `MarkupError`); our own styles are `Text` styles, never markup. A
control character is shown as an escape (`visible`), so a machine cannot drive the operator's terminal
(OSC 0 titles, OSC 52 clipboard writes, colours): in what rich renders always (a table cell cannot hold a
carriage return as written anyway; a newline stays a line break), in line-by-line output (`logs`,
`events`) on a terminal only, so a pipe gets the bytes; `--json` is always exact, and `logs --raw` writes
the bytes to a terminal too (docs/reference/status-events-logs.md, "User text in every other output").
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import msgspec
import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from bus.contract.fleet import RegionSummary, WorkerInfo
from bus.contract.machines import Machine
from orchestrator.apps.ownership import CREATED_BY_KEY, CREATED_FOR_KEY

UNBOUNDED = 10_000  # the width of a pipe or a file: wide enough that no table is squeezed


def _escapes() -> dict[int, str]:
    table = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}
    table.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
    return table


ESCAPES = _escapes()  # C0 controls, DEL and C1 controls: `\x1b`, `\x07`, `\x9b`; `\n`, `\r`, `\t` by name


@functools.cache
def _escapes_but(keep: str) -> dict[int, str]:
    return {c: e for c, e in ESCAPES.items() if chr(c) not in keep}


def visible(text: str, keep: str = "") -> str:
    """`text` with each control character (but those in `keep`) shown as an escape: ESC as `\\x1b`, a newline
    as `\\n`. Everything else, right-to-left marks and emoji included, is left as written (a backslash too:
    `--json` and `logs --raw` are the exact forms)."""
    return text.translate(_escapes_but(keep) if keep else ESCAPES)


def literal(text: str, style: str = "") -> Text:
    """`text` as a `Text` that shows it as written (no markup read, control characters visible) on any console."""
    return Text(visible(text, keep="\n"), style)


class CliConsole(Console):
    """A console that shows every string it is given literally (`visible`, no markup, no emoji codes), and,
    writing to a terminal, lets no control character through in text it did not make itself (its own
    escape sequences are styles and control segments)."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(visible(text, keep="\n"), **kwargs)  # a newline is a line break, as written

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        if self.is_terminal:  # a Text made from user text elsewhere, whole lines' "\n" kept
            buffer = [
                seg if seg.control or not seg.text else Segment(visible(seg.text, keep="\n"), seg.style)
                for seg in buffer
            ]
        return super()._render_buffer(buffer)


def make_console(stderr: bool = False) -> Console:
    """The CLI's console. Prose is never hard-wrapped (`soft_wrap`: a line meant to be pasted, such as an
    `export` or a command, stays one line; a terminal wraps it for the eye only). A pipe or a file
    (no terminal, no $COLUMNS asked for) gets plain text at no width limit, so nothing is cut or folded.
    User text is shown as written (`CliConsole`)."""
    made = CliConsole(soft_wrap=True, stderr=stderr, markup=False, emoji=False, highlight=False)
    if not made.is_terminal and not os.environ.get("COLUMNS", "").strip().isdigit():
        made.width = UNBOUNDED
    return made


console = make_console()


def heading(title: str) -> None:
    """A section heading: a rule on a terminal, one plain line elsewhere (a rule would be as wide as a pipe)."""
    if console.is_terminal:
        console.rule(title)
    else:
        console.print(f"-- {title} --", highlight=False)


class FitTable(Table):
    """A table that fits the screen one line a record, keeping its `no_wrap` columns (ids and names, which
    people copy) whole at any width.

    Its natural width when that fits. Else the other columns give way by a stated priority (`cut_first`:
    headers, least important first; then right to left): the least important is cut short with an ellipsis
    if that is enough (to no less than its header's width), else left out, then the next the same way; a line
    under the table names the columns left out and `--wide`. A column in `whole` (a bar and its numbers) is
    never cut, only left out. `--wide` draws every column whole: the terminal wraps it.
    Only when the key columns alone are wider than the screen: one record per block (the first column's
    value, then each other column's `header  value` on its own line).
    """

    FLOOR = 6  # a cut column keeps at least this many cells (or its header's width, or its whole value)

    def __init__(self, *args: Any, cut_first: Sequence[str] = (), whole: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cut_first = tuple(cut_first)
        self.whole = frozenset(whole)

    def _cut_order(self) -> list[int]:
        """The columns that may give way, least important first (the keys never do)."""
        headers = [str(c.header) for c in self.columns]
        named = [headers.index(h) for h in self.cut_first if h in headers]
        rest = [i for i in reversed(range(len(self.columns))) if i not in named]
        return [i for i in [*named, *rest] if not self.columns[i].no_wrap]

    def _view(self, keep: list[int], cut: dict[int, int]) -> Table:
        """This table with only the columns `keep`, those in `cut` at that width, one line a cell."""
        view = copy.copy(self)
        view.columns = [
            replace(
                self.columns[i],
                _index=n,
                width=cut.get(i, self.columns[i].width),
                no_wrap=True,
                overflow="ellipsis" if i in cut else self.columns[i].overflow,
            )
            for n, i in enumerate(keep)
        ]
        return view

    def _plan(self, console: Console, options: ConsoleOptions) -> tuple[list[int], dict[int, int]] | None:
        """The columns to show and the widths of those cut short, fitting `options.max_width`; None: blocks.

        The least important column gives way first, and wholly before the next is touched: cut short if that
        is enough, else left out; then the next. So a more important column is never cut to keep a lesser one."""
        wide = options.update_width(UNBOUNDED)
        most = [
            self._measure_column(console, wide, c).maximum - self._get_padding_width(c._index) for c in self.columns
        ]
        keep = list(range(len(self.columns)))

        def room() -> int:
            view = self._view(keep, {})
            return options.max_width - view._extra_width - sum(view._get_padding_width(n) for n in range(len(keep)))

        if sum(most) <= room():
            return keep, {}
        for i in self._cut_order():
            over = sum(most[k] for k in keep) - room()
            floor = min(most[i], max(self.FLOOR, cell_len(str(self.columns[i].header))))
            if most[i] - over >= floor and str(self.columns[i].header) not in self.whole:
                return keep, {i: most[i] - over}
            keep.remove(i)
            if sum(most[k] for k in keep) <= room():
                return keep, {}
        return None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if not self.columns:
            yield from super().__rich_console__(console, options)
            return
        if WIDE.on:
            yield from super().__rich_console__(console, options.update_width(UNBOUNDED))
            return
        plan = self._plan(console, options)
        if plan is None:
            yield from self._blocks(console)
            return
        keep, cut = plan
        yield from Table.__rich_console__(self._view(keep, cut), console, options)
        left_out = [str(c.header) for i, c in enumerate(self.columns) if i not in keep]
        if left_out:
            note = f"(left out at {options.max_width} columns: {', '.join(left_out)}; --wide shows them)"
            yield Text(note, "dim", no_wrap=False, overflow="fold")  # prose: wrapped at the width

    def add_row(self, *renderables: Any, **kwargs: Any) -> None:
        """A row whose strings are shown as written on any console (`literal`): styles come as `Text`."""
        super().add_row(*(literal(r) if isinstance(r, str) else r for r in renderables), **kwargs)

    def _cell(self, console: Console, value: Any) -> Text:
        if isinstance(value, Text):
            return value
        return literal(value) if isinstance(value, str) else Text(str(value))

    def _blocks(self, console: Console) -> Iterator[Text]:
        if self.title:
            yield self._cell(console, self.title)
        headers = [self._cell(console, c.header).plain for c in self.columns]
        pad = max(len(h) for h in headers[1:]) if len(headers) > 1 else 0
        for row in range(self.row_count):
            if row:
                yield Text()
            cells = [self._cell(console, c._cells[row]) for c in self.columns]
            yield Text.assemble((f"{headers[0]} ", "bold"), cells[0])
            for header, cell in zip(headers[1:], cells[1:], strict=True):
                yield Text.assemble(f"  {header:<{pad}}  ", cell)
        if self.caption:
            yield self._cell(console, self.caption)


class _Wide:
    """`--wide`: every table drawn whole, every column at its natural width (set by the option's callback)."""

    on = False


WIDE = _Wide()


def set_wide(value: bool) -> bool:
    """The `--wide` option's callback."""
    WIDE.on = WIDE.on or value
    return value


WideOption = typer.Option(
    False, "--wide", help="every column of every table, whole (the terminal wraps long lines)", callback=set_wide
)


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


def bar(used: int, total: int, width: int = 10) -> str:
    if total <= 0:
        return " " * width
    filled = round(width * min(1.0, used / total))
    return "█" * filled + "░" * (width - filled)


def pct(used: int, total: int) -> str:
    return f"{(100 * used / total) if total else 0:3.0f}%"


# columns whose values people copy (ids and names): a `FitTable` never cuts or folds them
KEYS = frozenset(
    {"id", "app", "name", "region", "worker", "volume", "attached", "version", "ID", "WORKER", "APP", "REGION"}
)

STATE_STYLE = {"started": "green", "failed": "red", "stopped": "yellow", "destroyed": "dim"}


def machines_table(machines: list[Machine], title: str | None = None) -> Table:
    """Machines as `machine list` shows them: at 80 columns the cmd, then the name, then the address give
    way first (cut short, then left out; `FitTable`), the id, region and worker never."""
    table = FitTable(
        title=title,
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        cut_first=("cmd", "name", "address", "port", "checks"),
    )
    for col in ("id", "region", "worker", "state", "checks", "port", "address", "name", "cmd"):
        table.add_column(col, overflow="fold", no_wrap=col in ("id", "region", "worker"))  # a name is free text
    for m in machines:
        checks = ", ".join(f"{n}:{c.status}" for n, c in sorted(m.checks.items())) or "-"
        style = STATE_STYLE.get(m.state, "")
        row: list[str | Text] = [m.id, m.region, m.worker_id, Text(m.state, style), checks]
        row += [str(m.port or "-"), m.address or "-", m.name or "-", " ".join(m.config.cmd)]
        table.add_row(*row)
    return table


def made_by(machine: Machine) -> str | None:
    """Who made the machine and why (`reconcile.ownership`'s labels), from its `created` event when it is among
    the events shown, else from its config; None for a machine made by hand with no such label."""
    created = [e.metadata for e in machine.events or [] if e.type == "transition" and e.status == "created"]
    for labels in [*created, machine.config.metadata]:
        who = (labels or {}).get(CREATED_BY_KEY)
        if who:
            why = (labels or {}).get(CREATED_FOR_KEY)
            return f"{who} ({why})" if why else who
    return None


def mem(mb: int) -> str:
    return f"{mb / 1024:.1f}G" if mb >= 1024 else f"{mb}M"


def workers_table(workers: list[WorkerInfo]) -> Table:
    table = FitTable(
        header_style="bold", box=box.SIMPLE_HEAD, cut_first=("load", "memory", "cpus"), whole=("cpus", "memory")
    )
    for col in ("region", "worker", "cpus", "memory", "mach", "load", "state"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for w in workers:
        table.add_row(
            w.region,
            w.worker_id,
            f"{bar(w.used.cpus, w.capacity.cpus, 6)} {w.used.cpus}/{w.capacity.cpus}",
            f"{bar(w.used.memory_mb, w.capacity.memory_mb, 6)} {mem(w.used.memory_mb)}/{mem(w.capacity.memory_mb)}",
            str(w.machines),
            f"{w.load:.2f}",
            Text("cordoned", "yellow") if w.cordoned else Text("ready", "green"),
        )
    return table


def regions_table(regions: list[RegionSummary]) -> Table:
    table = FitTable(header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("region", "workers", "cpus", "memory", "machines"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for r in regions:
        workers = f"{r.workers}" + (f" ({r.cordoned} cordoned)" if r.cordoned else "")
        table.add_row(
            r.region if r.reachable else Text.assemble(r.region, " ", ("(unreachable)", "red")),
            workers,
            f"{bar(r.used.cpus, r.capacity.cpus)} {r.used.cpus}/{r.capacity.cpus}",
            f"{bar(r.used.memory_mb, r.capacity.memory_mb)} {pct(r.used.memory_mb, r.capacity.memory_mb)}",
            str(r.machines),
        )
    return table


def explain_table(explain: dict[str, Any]) -> Table:
    table = FitTable(
        title=f"auction in {explain['region']} ({explain['strategy']}: {explain['answered']}/"
        f"{explain['asked']} workers answered in {explain['gather_ms']:.1f} ms)",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    for col in ("#", "worker", "total", "cpu", "mem", "image", "spread", "load", "away"):
        table.add_column(col, no_wrap=col == "worker", overflow="fold")
    for w in explain["workers"]:
        won = w["worker_id"] == explain.get("winner")
        name = Text(f"{w['worker_id']} ✓", "bold green") if won else w["worker_id"]
        if w["outcome"] == "candidate":
            s = w.get("subscores", {})
            table.add_row(
                str(w.get("rank")),
                name,
                f"{w.get('total', 0):.3f}",
                *(f"{s.get(k, 0):+.2f}" for k in SUBSCORES),
            )
        else:
            table.add_row("-", name, Text("no", "red"), w.get("reason", ""), "", "", "", "", "")
    return table


SUBSCORES = ("cpu", "memory", "image", "spread", "load", "away")


def kept_table(kept: dict[str, Any]) -> Table:
    """The short explanation a machine kept of its placement (`machine explain`)."""
    rejected = ", ".join(f"{n} by {name}" for name, n in sorted(kept.get("rejected", {}).items())) or "none"
    table = FitTable(
        title=f"placed on {kept['chosen']} ({kept['strategy']}: {kept['answered']}/{kept['asked']} workers answered"
        f" in {kept['gather_ms']:.1f} ms; {kept.get('feasible', 0)} feasible; rejected: {rejected})",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    for col in ("#", "worker", "total", "cpu", "mem", "image", "spread", "load", "away"):
        table.add_column(col, no_wrap=col == "worker", overflow="fold")
    for c in kept.get("candidates", []):
        won = c["worker_id"] == kept["chosen"]
        name = Text(f"{c['worker_id']} ✓", "bold green") if won else c["worker_id"]
        s = c.get("subscores", {})
        table.add_row(str(c["rank"]), name, f"{c['total']:.3f}", *(f"{s.get(k, 0):+.2f}" for k in SUBSCORES))
    for attempt in kept.get("attempts", []):
        table.caption = (table.caption + "; " if table.caption else "before: ") + (
            f"{attempt['worker_id']} {attempt['outcome']}"
        )
    return table
