"""Rendering for people (rich tables) and for programs (`--json`): one place for both."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.table import Table

from bus.contract.fleet import RegionSummary, WorkerInfo
from bus.contract.machines import Machine
from orchestrator.reconcile.ownership import CREATED_BY_KEY, CREATED_FOR_KEY

console = Console()


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


def bar(used: int, total: int, width: int = 10) -> str:
    if total <= 0:
        return " " * width
    filled = round(width * min(1.0, used / total))
    return "█" * filled + "░" * (width - filled)


def pct(used: int, total: int) -> str:
    return f"{(100 * used / total) if total else 0:3.0f}%"


STATE_STYLE = {"started": "green", "failed": "red", "stopped": "yellow", "destroyed": "dim"}


def machines_table(machines: list[Machine], title: str | None = None) -> Table:
    wide = console.width >= 120
    table = Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    columns = ["id", "region", "worker", "state", "port", "checks"] + (["name", "cmd"] if wide else [])
    for col in columns:
        table.add_column(col, overflow="fold" if col == "cmd" else "ellipsis", no_wrap=col != "cmd")
    for m in machines:
        checks = ",".join(f"{n}:{c.status}" for n, c in sorted(m.checks.items())) or "-"
        style = STATE_STYLE.get(m.state, "")
        row = [m.id, m.region, m.worker_id, f"[{style}]{m.state}[/]" if style else m.state, str(m.port or "-"), checks]
        if wide:
            row += [m.name, " ".join(m.config.cmd)[:60]]
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
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("region", "worker", "cpus", "memory", "mach", "load", "state"):
        table.add_column(col, no_wrap=True)
    for w in workers:
        table.add_row(
            w.region,
            w.worker_id,
            f"{bar(w.used.cpus, w.capacity.cpus, 6)} {w.used.cpus}/{w.capacity.cpus}",
            f"{bar(w.used.memory_mb, w.capacity.memory_mb, 6)} {mem(w.used.memory_mb)}/{mem(w.capacity.memory_mb)}",
            str(w.machines),
            f"{w.load:.2f}",
            "[yellow]cordoned[/]" if w.cordoned else "[green]ready[/]",
        )
    return table


def regions_table(regions: list[RegionSummary]) -> Table:
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("region", "workers", "cpus", "memory", "machines"):
        table.add_column(col, no_wrap=True)
    for r in regions:
        workers = f"{r.workers}" + (f" ({r.cordoned} cordoned)" if r.cordoned else "")
        table.add_row(
            r.region if r.reachable else f"{r.region} [red](unreachable)[/]",
            workers,
            f"{bar(r.used.cpus, r.capacity.cpus)} {r.used.cpus}/{r.capacity.cpus}",
            f"{bar(r.used.memory_mb, r.capacity.memory_mb)} {pct(r.used.memory_mb, r.capacity.memory_mb)}",
            str(r.machines),
        )
    return table


def explain_table(explain: dict[str, Any]) -> Table:
    table = Table(
        title=f"auction in {explain['region']} ({explain['strategy']}: {explain['answered']}/"
        f"{explain['asked']} workers answered in {explain['gather_ms']:.1f} ms)",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    for col in ("#", "worker", "total", "cpu", "mem", "image", "spread", "load", "away"):
        table.add_column(col, no_wrap=col != "cpu")
    for w in explain["workers"]:
        won = w["worker_id"] == explain.get("winner")
        name = f"[bold green]{w['worker_id']} ✓[/]" if won else w["worker_id"]
        if w["outcome"] == "candidate":
            s = w.get("subscores", {})
            table.add_row(
                str(w.get("rank")),
                name,
                f"{w.get('total', 0):.3f}",
                *(f"{s.get(k, 0):+.2f}" for k in SUBSCORES),
            )
        else:
            table.add_row("-", name, "[red]no[/]", w.get("reason", ""), "", "", "", "", "")
    return table


SUBSCORES = ("cpu", "memory", "image", "spread", "load", "away")


def kept_table(kept: dict[str, Any]) -> Table:
    """The short explanation a machine kept of its placement (`machine explain`)."""
    rejected = ", ".join(f"{n} by {name}" for name, n in sorted(kept.get("rejected", {}).items())) or "none"
    table = Table(
        title=f"placed on {kept['chosen']} ({kept['strategy']}: {kept['answered']}/{kept['asked']} workers answered"
        f" in {kept['gather_ms']:.1f} ms; {kept.get('feasible', 0)} feasible; rejected: {rejected})",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    for col in ("#", "worker", "total", "cpu", "mem", "image", "spread", "load", "away"):
        table.add_column(col, no_wrap=True)
    for c in kept.get("candidates", []):
        won = c["worker_id"] == kept["chosen"]
        name = f"[bold green]{c['worker_id']} ✓[/]" if won else c["worker_id"]
        s = c.get("subscores", {})
        table.add_row(str(c["rank"]), name, f"{c['total']:.3f}", *(f"{s.get(k, 0):+.2f}" for k in SUBSCORES))
    for attempt in kept.get("attempts", []):
        table.caption = (table.caption + "; " if table.caption else "before: ") + (
            f"{attempt['worker_id']} {attempt['outcome']}"
        )
    return table
