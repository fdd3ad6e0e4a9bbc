"""The console's HTML: one function per page, plain strings with every value escaped.

Each page names its live stream in `<body data-stream=...>`; `static/console.js` opens it and updates the
elements marked with `data-machine`, `data-worker`, `data-live` (a section fetched again when told).
"""

from __future__ import annotations

import time
from html import escape
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode

from bus.contract.jobs import Job
from bus.contract.machines import Machine
from orchestrator.console import charts
from orchestrator.console.data import AppData, ago
from orchestrator.console.live import Sample
from orchestrator.logs import LogRecord, iso_time
from orchestrator.view.model import LOST, MachineRow, Snapshot, WorkerRow

ACTIONS = ("start", "stop", "restart", "suspend", "resume", "destroy")
# the states in which each action does something (the worker's rules: workers/lifecycle/manager.py, STARTABLE in
# workers/log/machine_states.py); in any other its button is disabled, and the script keeps that as the state moves.
# The worker also takes a start while a machine is stopping (it waits for the stop): the button waits for `stopped`.
ACTS_IN = {
    "start": ("created", "stopped", "failed"),
    "stop": ("started", "starting", "suspending", "suspended"),
    "restart": ("created", "started", "stopped", "failed", "suspended"),
    "suspend": ("started",),
    "resume": ("suspended",),
    "destroy": (
        "created",
        "starting",
        "started",
        "stopping",
        "stopped",
        "failed",
        "suspending",
        "suspended",
        "replacing",
    ),
}


def e(value: object) -> str:
    return escape(str(value), quote=True)


class Who(NamedTuple):
    """The viewer as a page shows it: `name` in the header (none: an open API, no logout), and the anti-CSRF
    token of its session, which the page's actions and its logout form send back (`orchestrator.console.guard`)."""

    name: str = ""
    csrf: str = ""


NOBODY = Who()  # the pages with no viewer: logging in, refusals, not found


def layout(title: str, body: str, *, stream: str = "", who: Who = NOBODY, status: int = 200) -> str:
    del status
    nav = (
        '<nav><a href="/ui/">Fleet</a> <a href="/ui/jobs">Jobs</a> <a href="/ui/heatmap">Heatmap</a>'
        + (
            f' <span class="who">{e(who.name)}</span> <form method="post" action="/ui/logout" class="inline">'
            f'<input type="hidden" name="csrf" value="{e(who.csrf)}"><button type="submit">log out</button></form>'
            if who.name
            else ""
        )
        + "</nav>"
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width"><meta name="fauxmad-csrf" content="{e(who.csrf)}">'
        f"<title>{e(title)} · fauxmad</title>"
        # its icon: without one a browser asks /favicon.ico, a 404
        '<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="/ui/static/console.css"><script src="/ui/static/console.js" defer></script>'
        f'</head><body data-stream="{e(stream)}"><header><b>fauxmad</b> {nav}</header><main>{body}'
        '<p id="live-status" class="muted" aria-live="polite"></p></main></body></html>'  # inside the margin
    )


def login(message: str = "", *, next_url: str = "/ui/") -> str:
    note = f'<p class="error" role="alert">{e(message)}</p>' if message else ""
    return layout(
        "log in",
        f"<h1>Log in</h1>{note}<p>Paste a token of this API (<code>fauxmad token mint</code> makes them).</p>"
        f'<form method="post" action="/ui/login"><input type="hidden" name="next" value="{e(next_url)}">'
        '<label>token <input type="password" name="token" id="token" size="60" autocomplete="off" required></label> '
        '<button type="submit" id="login">log in</button></form>',
    )


def refused(status: int, message: str) -> str:
    what = "Not logged in" if status == 401 else "Not allowed"
    return layout(
        what, f'<h1>{what}</h1><p class="error" role="alert">{e(message)}</p><p><a href="/ui/login">Log in</a></p>'
    )


def trouble(message: str) -> str:
    return layout("not answered", f'<h1>Not answered</h1><p class="error">{e(message)}</p>')


def not_found(message: str) -> str:
    return layout("not found", f'<h1>Not found</h1><p class="error">{e(message)}</p><p><a href="/ui/">Fleet</a></p>')


# ---------------------------------------------------------------------------------------------------
# fleet


def machine_href(app: str, machine_id: str) -> str:
    return f"/ui/apps/{quote(app)}/machines/{quote(machine_id)}"


def _chip(m: MachineRow) -> str:
    """A machine's square: as small as it can be (a thousand of them on the fleet page); its tooltip is made on
    hover by the script, from its link and its class."""
    return f'<a class="m s-{e(m.state)}" data-machine="{e(m.id)}" href="{machine_href(m.app, m.id)}"></a>'


def fill(share: float) -> str:
    """A bar's filled part, `share` of it (0 to 1): an SVG rectangle, whose width is an attribute, since the
    console's Content-Security-Policy allows no inline style (the script moves it the same way)."""
    return (
        '<svg viewBox="0 0 100 1" preserveAspectRatio="none" aria-hidden="true">'
        f'<rect width="{min(100.0, max(0.0, share * 100)):.0f}" height="1"/></svg>'
    )


def _bar(kind: str, used: float, capacity: float, unit: str) -> str:
    share = used / capacity if capacity else 0.0
    return (
        f'<div class="bar" data-bar="{kind}" title="{kind}">{fill(share)}'
        f"<em>{kind} {used:g}/{capacity:g}{unit}</em></div>"
    )


def _worker(w: WorkerRow, machines: list[MachineRow]) -> str:
    mark = {"cordoned": '<span class="badge cordoned">cordoned</span>', LOST: '<span class="badge lost">lost</span>'}
    return (
        f'<div class="worker w-{e(w.status)}" data-worker="{e(w.worker_id)}"><h3>{e(w.worker_id)} '
        f"{mark.get(w.status, '')}</h3>"
        + _bar("cpu", w.used.cpus, w.capacity.cpus, "")
        + _bar("mem", w.used.memory_mb, w.capacity.memory_mb, " MB")
        + '<div class="machines">'
        + "".join(_chip(m) for m in machines)
        + "</div></div>"
    )


def legend() -> str:
    states = ("created", "starting", "started", "stopping", "stopped", "suspended", "failed", "replacing")
    return '<p class="legend">' + " ".join(f'<span class="m s-{s}"></span>{s}' for s in states) + "</p>"


def fleet(snap: Snapshot, *, app: str | None, apps: list[str], who: Who) -> str:
    by_worker: dict[str, list[MachineRow]] = {}
    for m in snap.machines:
        by_worker.setdefault(m.worker_id, []).append(m)
    options = "".join(f'<option value="{e(a)}"{" selected" if a == app else ""}>{e(a)}</option>' for a in apps)
    parts = [
        f'<h1>Fleet</h1><form method="get" class="filter"><label>app <select name="app" id="app-filter" '
        f'onchange="this.form.submit()"><option value="">all</option>{options}</select></label>'
        f'<noscript><button type="submit">filter</button></noscript></form>{legend()}'
    ]
    for region in snap.regions:
        workers = [w for w in snap.workers if w.region == region.region]
        lost = f", {region.lost} lost" if region.lost else ""
        cordoned = f", {region.cordoned} cordoned" if region.cordoned else ""
        parts.append(
            f'<section class="region" data-region="{e(region.region)}"><h2>{e(region.region)} '
            f"<small>{region.workers} workers{cordoned}{lost}, {region.machines} machines</small></h2>"
            '<div class="workers">'
            + "".join(_worker(w, by_worker.get(w.worker_id, [])) for w in workers)
            + "</div></section>"
        )
    if not snap.regions:
        parts.append('<p class="muted">no worker has reported yet</p>')
    query = f"?{urlencode({'app': app})}" if app else ""
    return layout("fleet", "".join(parts), stream=f"/ui/stream{query}", who=who)


# ---------------------------------------------------------------------------------------------------
# machine


def _when(ms: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1000)) + f".{int(ms) % 1000:03d}"


def timeline_item(event: Any) -> str:
    reason = f" — {e(event.reason)}" if event.reason else ""
    frm = f"{e(event.from_state)} → " if event.from_state else ""
    return (
        f'<li class="t-{e(event.type)}"><time>{_when(event.timestamp)}</time> <b>{e(event.type)}</b> '
        f'{frm}<span class="s-{e(event.status)}">{e(event.status)}</span>{reason}</li>'
    )


def _placement(kept: dict[str, Any] | None) -> str:
    if kept is None:
        return '<p class="muted">no placement kept (reserved straight on its worker, not through a broker)</p>'
    rejected = ", ".join(f"{n} by {e(name)}" for name, n in sorted(kept.get("rejected", {}).items())) or "none"
    attempts = "; ".join(f"{e(a['worker_id'])} {e(a['outcome'])}" for a in kept.get("attempts", []))
    before = f"<p>before: {attempts}</p>" if attempts else ""
    return (
        f'<p id="explain-summary">placed on <b>{e(kept.get("chosen", "?"))}</b> by {e(kept.get("strategy", "?"))}: '
        f"{e(kept.get('answered', 0))}/{e(kept.get('asked', 0))} workers answered in "
        f"{float(kept.get('gather_ms', 0)):.1f} ms; {e(kept.get('feasible', 0))} feasible; "
        f'rejected by filters: <span id="explain-rejected">{rejected}</span></p>{before}' + charts.explain(kept)
    )


def log_line(record: LogRecord, *, with_machine: bool = False) -> str:
    line = record.line
    who = f"{e(line.machine_id)} " if with_machine else ""
    return f'<div class="log {e(line.stream)}">{e(iso_time(line.timestamp))} {who}{e(line.line)}</div>'


def machine(found: Machine, kept: dict[str, Any] | None, logs: list[LogRecord], *, who: Who, may_act: bool) -> str:
    events = sorted(found.events if isinstance(found.events, list) else [], key=lambda ev: (ev.timestamp, ev.seq))
    checks = "".join(
        f'<tr><td>{e(name)}</td><td class="c-{e(c.status)}">{e(c.status)}</td><td>{e(c.output)}</td></tr>'
        for name, c in sorted(found.checks.items())
    )
    hint = "" if may_act else ' title="your token may not act on this app"'
    buttons = "".join(
        f'<button type="button" data-action="{a}" data-when="{" ".join(ACTS_IN[a])}"'
        f' class="{"danger" if a == "destroy" else ""}"{hint}{"" if found.state in ACTS_IN[a] else " disabled"}>'
        f"{a}</button>"
        for a in ACTIONS
    )
    body = (
        f'<h1>machine {e(found.id)}</h1><p>app <a href="/ui/apps/{quote(found.app)}">{e(found.app)}</a> · region '
        f"{e(found.region)} · worker {e(found.worker_id)}"
        + (f" · address {e(found.address)}" if found.address else "")
        + " · state "
        f'<b id="state" class="s-{e(found.state)}" data-machine="{e(found.id)}" data-text="1">{e(found.state)}</b></p>'
        f'<div class="actions" data-app="{e(found.app)}" data-id="{e(found.id)}">{buttons}</div>'
        '<p id="outcome" role="status"></p>'
        f"<h2>Placement</h2>{_placement(kept)}"
        + (f"<h2>Health checks</h2><table>{checks}</table>" if checks else "")
        + '<h2>Events</h2><ol id="timeline" class="timeline" data-machine-timeline="'
        + e(found.id)
        + '">'
        + "".join(timeline_item(ev) for ev in events)
        + '</ol><h2>Logs</h2><div id="logs" class="logs">'
        + "".join(log_line(r) for r in logs)
        + "</div>"
    )
    stream = f"/ui/stream?{urlencode({'app': found.app, 'machine': found.id})}"
    return layout(f"machine {found.id}", body, stream=stream, who=who)


# ---------------------------------------------------------------------------------------------------
# app


def _checks(checks: dict[str, str]) -> str:
    return " ".join(f'<span class="c-{e(s)}">{e(n)}: {e(s)}</span>' for n, s in sorted(checks.items())) or "-"


def app_live(data: AppData) -> str:
    """The part of the app page that is fetched again when its events say it changed."""
    rows = "".join(
        f'<tr><td>v{r.version}</td><td class="r-{e(r.status)}">{e(r.status)}</td><td>{e(r.spec.deploy.strategy)}</td>'
        f"<td>{e(r.reason or r.description)}</td><td>{e(ago(r.updated_at))}</td></tr>"
        for r in reversed(data.releases)
    )
    head = f"current: v{data.head.version}" if data.head and data.head.version else "no current release"
    progress = "".join(
        f'<tr data-progress-region="{e(p.region)}"><td>{e(p.region)}</td><td>{p.started}/{p.wanted}</td>'
        f'<td><div class="bar">{fill(p.started / p.wanted if p.wanted else 1.0)}</div></td>'
        f"<td>{p.of_release}</td><td>{p.older}</td></tr>"
        for p in data.progress
    )
    newest = data.releases[-1] if data.releases else None
    machines = "".join(
        f'<tr><td><a href="{machine_href(m.app, m.id)}">{e(m.id)}</a></td><td>{e(m.region)}</td>'
        f'<td class="s-{e(m.state)}" data-machine="{e(m.id)}" data-text="1">{e(m.state)}</td>'
        f"<td>{'v' + e(m.release) if m.release else '-'}</td><td>{e(m.role or '-')}</td>"
        f"<td>{_checks(m.checks)}</td></tr>"
        for m in data.machines
    )
    edge = ""
    if data.edge is not None:
        missing = (
            f' <span class="error">no answer from {e(", ".join(data.edge.unanswered))}</span>'
            if (data.edge.unanswered)
            else ""
        )
        edge = (
            f'<h2>Edge</h2><p id="edge">{data.edge.requests} requests ({data.edge.errors} 5xx), '
            f"{data.edge.autostarts} autostarts, {data.edge.resumes} resumes, from {data.edge.proxies} proxies"
            f"{missing}</p>"
        )
    else:
        edge = (
            '<h2>Edge</h2><p class="muted">no proxy to read: start the API with <code>--proxy-metrics '
            "http://HOST:PORT/metrics</code> (a proxy's <code>--admin</code> listener)</p>"
        )
    deploy = (
        f'<h2>Deploy of v{newest.version} <small class="r-{e(newest.status)}">{e(newest.status)}</small></h2>'
        f'<table id="progress"><tr><th>region</th><th>started</th><th></th><th>of v{newest.version}</th>'
        f"<th>older</th></tr>{progress}</table>"
        if newest
        else ""
    )
    return (
        f'<h2>Releases <small>{head}</small></h2><table id="releases"><tr><th>release</th><th>status</th>'
        f"<th>strategy</th><th>reason</th><th>updated</th></tr>{rows}</table>{deploy}"
        f'<h2>Machines</h2><table id="machines"><tr><th>id</th><th>region</th><th>state</th><th>release</th>'
        f"<th>role</th><th>checks</th></tr>{machines}</table>{edge}"
    )


def app(data: AppData, logs: list[LogRecord], *, who: Who) -> str:
    body = (
        f'<h1>app {e(data.name)}</h1><div data-live="/ui/apps/{quote(data.name)}?part=live">{app_live(data)}</div>'
        '<h2>Logs</h2><div id="logs" class="logs">' + "".join(log_line(r, with_machine=True) for r in logs) + "</div>"
    )
    return layout(
        f"app {data.name}",
        body,
        stream=f"/ui/stream?{urlencode({'app': data.name, 'logs': '1', 'releases': '1'})}",
        who=who,
    )


# ---------------------------------------------------------------------------------------------------
# jobs and the heatmap


def jobs_live(found: list[Job]) -> str:
    counts: dict[tuple[str, str], int] = {}
    for j in found:
        counts[(j.region, j.state)] = counts.get((j.region, j.state), 0) + 1
    regions = sorted({r for r, _ in counts})
    states = ("queued", "running", "succeeded", "failed", "cancelled")
    table = "".join(
        f"<tr><td>{e(r)}</td>" + "".join(f"<td>{counts.get((r, s), 0)}</td>" for s in states) + "</tr>" for r in regions
    )
    rows = "".join(
        f'<tr><td><a href="/ui/apps/{quote(j.app)}/jobs/{quote(j.id)}">{e(j.id)}</a></td><td>{e(j.app)}</td>'
        f'<td>{e(j.region)}</td><td class="j-{e(j.state)}">{e(j.state)}</td><td>{j.attempt}/{j.max_attempts}</td>'
        f"<td>{e(ago(j.submitted_at))}</td><td>{e(j.reason)}</td></tr>"
        for j in found
    )
    return (
        '<h2>By region</h2><table id="job-counts"><tr><th>region</th>'
        + "".join(f"<th>{s}</th>" for s in states)
        + f'</tr>{table}</table><h2>Jobs</h2><table id="jobs"><tr><th>id</th><th>app</th><th>region</th>'
        f"<th>state</th><th>attempt</th><th>submitted</th><th>reason</th></tr>{rows}</table>"
    )


def jobs(found: list[Job], *, app: str | None, who: Who) -> str:
    query = f"?{urlencode({'app': app})}" if app else ""
    body = (
        f'<h1>Jobs</h1><div data-live="/ui/jobs?part=live{"&" + query[1:] if query else ""}">{jobs_live(found)}</div>'
    )
    return layout(
        "jobs", body, stream=f"/ui/stream?{urlencode({'jobs': '1', **({'app': app} if app else {})})}", who=who
    )


def job(found: Job, *, who: Who) -> str:
    attempts = "".join(
        f"<tr><td>{a.attempt}</td><td>{e(a.worker_id)}</td><td>{e(a.machine_id or '-')}</td><td>{e(a.outcome)}</td>"
        f"<td>{'-' if a.exit_code is None else a.exit_code}</td><td>{e(ago(a.claimed_at))}</td>"
        f"<td>{'-' if not a.finished_at or not a.started_at else f'{a.finished_at - a.started_at:.1f} s'}</td></tr>"
        for a in found.attempts
    )
    body = (
        f"<h1>job {e(found.id)}</h1><p>app {e(found.app)} · region {e(found.region)} · state "
        f'<b class="j-{e(found.state)}">{e(found.state)}</b> · <code>{e(" ".join(found.cmd))}</code></p>'
        f'<p>{e(found.reason)}</p><h2>Attempts</h2><table id="attempts"><tr><th>#</th><th>worker</th>'
        f"<th>machine</th><th>outcome</th><th>exit</th><th>claimed</th><th>ran</th></tr>{attempts}</table>"
        f'<h2>Output</h2><pre>{e(found.stdout)}</pre><pre class="stderr">{e(found.stderr)}</pre>'
    )
    return layout(f"job {found.id}", body, stream=f"/ui/stream?{urlencode({'jobs': '1', 'app': found.app})}", who=who)


def heatmap_live(history: list[Sample], workers: list[str]) -> str:
    return charts.heatmap(history, workers)


def heatmap(history: list[Sample], workers: list[str], *, who: Who) -> str:
    body = (
        "<h1>Utilization</h1><p>Each worker's cpu in use over the last minutes (a sample every 2 s; grey "
        'idle, red full).</p><div data-live="/ui/heatmap?part=live" data-on="tick">'
        f"{heatmap_live(history, workers)}</div>"
    )
    return layout("heatmap", body, stream="/ui/stream?ticks=1", who=who)
