"""Rendering the systemwide view: `status` tables, event lines, and the live view's layout.

Everything here is a pure function of a `Snapshot` (and the width it must fit), so tests render it
into a `Console` writing to a string at any width and read what a person would see.
"""

from __future__ import annotations

import time
from collections import defaultdict

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from bus.contract.machines import MachineEvent
from bus.contract.offers import Resources
from orchestrator.cli.render import KEYS, STATE_STYLE, FitTable, bar, literal, mem, visible
from orchestrator.view import model
from orchestrator.view.model import CORDONED, LOST, READY

STYLES = {
    **STATE_STYLE,
    "created": "cyan",
    "starting": "blue",
    "stopping": "blue",
    "replacing": "magenta",
    "suspending": "cyan",
    "suspended": "cyan",
    "destroying": "dim",
    READY: "green",
    CORDONED: "yellow",
    LOST: "red",
    "passing": "green",
    "warning": "yellow",
    "critical": "red",
}
STATE_ORDER = (
    "started",
    "starting",
    "replacing",
    "suspending",
    "suspended",
    "created",
    "stopping",
    "stopped",
    "failed",
    "destroying",
)
SPARE = "spare"


def styled(value: str, style_key: str | None = None) -> Text:
    """`value` in the style of its state (a `Text`: our styles are never markup, `render.literal`)."""
    return literal(value or "-", STYLES.get(style_key or value, "") if value else "")


def ago(moment: float | None, now: float) -> str:
    if not moment:
        return "never"
    delta = max(0.0, now - moment)
    if delta < 60:
        return f"{delta:.1f}s ago"
    if delta < 3600:
        return f"{delta / 60:.0f}m ago"
    return f"{delta / 3600:.0f}h ago"


def clock_time(ms: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ms / 1000))


def iso_time(ms: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{int(ms % 1000):03d}Z"


def transition(status: str, from_state: str | None, kind: str) -> str:
    if kind != "transition":
        return f"{kind} ({status})" if status else kind
    return f"{from_state}→{status}" if from_state else status


def states_text(states: dict[str, int]) -> Text:
    ordered = sorted(states.items(), key=lambda item: (_rank(item[0]), item[0]))
    return Text(" ").join(Text.assemble(styled(str(n), state), f" {state}") for state, n in ordered if n) or Text("-")


def cpu_use(used: Resources, capacity: Resources, width: int) -> str:
    return f"{bar(used.cpus, capacity.cpus, width)} {used.cpus}/{capacity.cpus}"


def mem_use(used: Resources, capacity: Resources, width: int) -> str:
    return f"{bar(used.memory_mb, capacity.memory_mb, width)} {mem(used.memory_mb)}/{mem(capacity.memory_mb)}"


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _rank(state: str) -> int:
    return STATE_ORDER.index(state) if state in STATE_ORDER else len(STATE_ORDER)


# ---------------------------------------------------------------------------------------------------
# `fauxmad status`


def regions_table(regions: list[model.RegionRow]) -> Table:
    table = FitTable(
        title="regions",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        cut_first=("memory", "cpus"),
        whole=("cpus", "memory"),  # a bar without its numbers says nothing
    )
    for col in ("region", "workers", "cpus", "memory", "machines"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for r in regions:
        extra = [Text(f"{r.cordoned} cordoned")] * bool(r.cordoned) + [styled(f"{r.lost} lost", LOST)] * bool(r.lost)
        table.add_row(
            r.region,
            Text.assemble(f"{r.workers}", Text.assemble(" (", Text(", ").join(extra), ")") if extra else ""),
            cpu_use(r.used, r.capacity, 8),
            mem_use(r.used, r.capacity, 8),
            Text.assemble(f"{r.machines}: ", states_text(r.states)) if r.machines else "0",
        )
    return table


def workers_table(workers: list[model.WorkerRow], now: float) -> Table:
    table = FitTable(
        title="workers",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        cut_first=("address", "heartbeat", "memory", "cpus"),  # at 80 columns (`FitTable`)
        whole=("cpus", "memory"),  # a bar without its numbers says nothing
    )
    for col in ("region", "worker", "address", "status", "cpus", "memory", "mach", "heartbeat"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for w in workers:
        table.add_row(
            w.region,
            w.worker_id,
            w.address or "-",
            styled(w.status),
            cpu_use(w.used, w.capacity, 6),
            mem_use(w.used, w.capacity, 6),
            str(w.machines),
            ago(w.heartbeat_at, now),
        )
    return table


def machines_table(machines: list[model.MachineRow]) -> Table:
    table = FitTable(
        title="machines",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
        cut_first=("checks", "role", "release"),  # at 80 columns (`FitTable`); the state stays
    )
    for col in ("id", "app", "region", "worker", "state", "release", "role", "checks"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")  # ids and names are never cut
    for m in machines:
        state = styled(m.state)
        if m.state in ("stopped", "failed") and m.exit_code is not None:
            state.append(f" ({m.exit_code})")
        if m.host_status != "ok":
            state.append(f" host {m.host_status}", "red")  # as its worker last said; the host is not answering
        checks = Text(", ").join(
            Text.assemble(literal(name), ":", styled(status)) for name, status in sorted(m.checks.items())
        ) or Text("-")
        table.add_row(m.id, m.app, m.region, m.worker_id, state, m.release or "-", m.role or "-", checks)
    return table


def event_line(stream_seq: int, event: MachineEvent) -> str:
    """One event for `fauxmad events` (plain text, no markup: it goes to pipes as often as to terminals)."""
    who = f"{event.region}/{event.worker_id}"
    what = transition(event.status, event.from_state, event.type)
    why = f"  {event.reason}" if event.reason else ""
    return f"{iso_time(event.timestamp)}  {stream_seq:>7}  {who:<14} {event.app:<12} {event.machine_id}  {what}{why}"


# ---------------------------------------------------------------------------------------------------
# `fauxmad status --watch`


def layout(
    snap: model.Snapshot, *, width: int, height: int = 40, source: str = "", app: str | None = None
) -> RenderableType:
    """The whole live screen for one snapshot: header, a panel per region, the latest events."""
    regions = [r for r in snap.regions if r.workers or r.lost or r.machines]
    panels: list[RenderableType] = [region_panel(r, snap.workers, snap.groups, width) for r in regions]
    if not panels:
        panels = [Text("no workers have reported yet" if app is None else f"no machines of app {app}", style="dim")]
    columns = min(len(panels), 1 if width < 150 else 2 if width < 220 else 3)
    body: RenderableType = Group(*panels)
    if columns > 1:
        grid = Table.grid(expand=True, padding=(0, 1))
        for _ in range(columns):
            grid.add_column(ratio=1)
        for start in range(0, len(panels), columns):
            row = panels[start : start + columns]
            grid.add_row(*row, *([""] * (columns - len(row))))
        body = grid
    used = (
        4
        + sum(len(_workers_of(r.region, snap.workers)) + len(_apps_of(r.region, snap.groups)) + 3 for r in regions)
        // columns
    )
    tail = max(3, min(len(snap.events), height - used - 3))
    return Group(header(snap, source, app), body, events_panel(snap.events[-tail:]))


def header(snap: model.Snapshot, source: str, app: str | None) -> RenderableType:
    beating = [w for w in snap.workers if w.status != LOST]
    capacity = Resources(
        cpus=sum(w.capacity.cpus for w in beating), memory_mb=sum(w.capacity.memory_mb for w in beating)
    )
    used = Resources(cpus=sum(w.used.cpus for w in beating), memory_mb=sum(w.used.memory_mb for w in beating))
    states: dict[str, int] = defaultdict(int)
    spares = 0
    for group in snap.groups:
        if group.role == SPARE:
            spares += group.count
        else:
            states[group.state] += group.count
    lost = len(snap.workers) - len(beating)
    cordoned = sum(w.status == CORDONED for w in beating)
    title = Text.assemble(
        ("fauxmad status", "bold"),
        Text.assemble(" · app ", (app, "bold")) if app else "",
        "  ",
        (visible(source), "dim"),
        f"  {time.strftime('%H:%M:%S', time.localtime(snap.taken_at))}  ",
        (f"event #{snap.stream_seq} · q quits", "dim"),
    )
    fleet = Text.assemble(
        f"{plural(len(snap.regions), 'region')} · workers {len(beating) - cordoned} ",
        styled(READY),
        Text.assemble(f", {cordoned} ", styled("cordoned")) if cordoned else "",
        Text.assemble(f", {lost} ", styled("lost")) if lost else "",
        f" · cpu {cpu_use(used, capacity, 8)} · mem {mem_use(used, capacity, 8)}",
    )
    machines = Text.assemble(
        f"machines {sum(states.values())}: ", states_text(dict(states)), f" · spares {spares}" if spares else ""
    )
    return Group(title, fleet, machines)


def _workers_of(region: str, workers: list[model.WorkerRow]) -> list[model.WorkerRow]:
    return [w for w in workers if w.region == region]


def _apps_of(region: str, groups: list[model.MachineGroup]) -> list[str]:
    return sorted({g.app for g in groups if g.region == region})


def region_panel(
    region: model.RegionRow, workers: list[model.WorkerRow], groups: list[model.MachineGroup], width: int
) -> Panel:
    bars = 6 if width < 100 else 10
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, overflow="ellipsis", max_width=16)
    for _ in range(4):
        grid.add_column(no_wrap=True)
    for w in _workers_of(region.region, workers):
        grid.add_row(
            literal(w.worker_id),
            f"cpu {cpu_use(w.used, w.capacity, bars)}",
            f"mem {mem_use(w.used, w.capacity, bars)}",
            f"{w.machines}m",
            styled(w.status),
        )
    apps = Table.grid(padding=(0, 1))
    apps.add_column(no_wrap=True, overflow="ellipsis", max_width=16, style="bold")
    apps.add_column(overflow="fold")
    for app_name in _apps_of(region.region, groups):
        mine = [g for g in groups if g.region == region.region and g.app == app_name]
        states: dict[str, int] = defaultdict(int)
        spares: dict[str, int] = defaultdict(int)
        for group in mine:
            (spares if group.role == SPARE else states)[group.state] += group.count
        text = states_text(dict(states)) if states else Text()
        if spares:
            text.append(f"{' · ' if text else ''}spares {sum(spares.values())}")
            if set(spares) != {"created"}:
                text.append_text(Text.assemble(" (", states_text(dict(spares)), ")"))
        apps.add_row(literal(app_name), text)
    title = Text.assemble(
        (region.region, "bold"),
        f" {plural(region.workers, 'worker')}",
        Text.assemble(", ", styled(f"{region.lost} lost", LOST)) if region.lost else "",
        f" · cpu {region.used.cpus}/{region.capacity.cpus} · mem {mem(region.used.memory_mb)}/"
        f"{mem(region.capacity.memory_mb)} · {plural(region.machines, 'machine')}",
    )
    return Panel(Group(grid, apps), title=title, title_align="left", box=box.ROUNDED, padding=(0, 1))


def events_panel(events: list[model.EventRow]) -> Panel:
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(no_wrap=True, overflow="ellipsis", max_width=12)
    grid.add_column(no_wrap=True, overflow="ellipsis", max_width=12, style="bold")
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, overflow="ellipsis", ratio=1, style="dim")
    for e in events:
        grid.add_row(
            clock_time(e.timestamp),
            literal(e.worker_id),
            literal(e.app),
            literal(e.machine_id),
            styled(transition(e.status, e.from_state, e.type), e.status),
            literal(e.reason or ""),
        )
    if not events:
        grid.add_row("", "", "", Text("no events yet", style="dim"), "", "")
    return Panel(grid, title="recent events", title_align="left", box=box.ROUNDED, padding=(0, 1))
