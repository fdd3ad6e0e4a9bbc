"""`fauxmad status [--watch]` and `fauxmad events`: the fleet as the systemwide view sees it.

`status` brings the local view (a SQLite cache of the events stream and the heartbeats) up to the
stream's current end, then answers from it without asking any worker. `events` reads the stream
itself, filtered on the server.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import typer

from orchestrator.cli.render import WideOption, console, print_json, visible
from orchestrator.cli.runtime import (
    EXIT_NOT_FOUND,
    JsonOption,
    NatsOption,
    check_app,
    check_machine_id,
    fail,
    nats_url,
    run,
    serve,
    serve_client,
    with_client,
)
from orchestrator.cli.view_render import event_line, machines_table, regions_table, workers_table
from orchestrator.view.history import SINCE_HELP, EventQuery, parse_since
from orchestrator.view.model import Snapshot

if TYPE_CHECKING:
    from rich.table import Table

    from bus.contract.jobs import JobEvent
    from orchestrator.jobs.view import JobCount

CATCH_UP_TIMEOUT = 10.0

AppOption = typer.Option(
    None, "--app", "-a", help="only this app's machines (and the workers holding them)", callback=check_app
)
ViewOption = typer.Option(
    None,
    "--view",
    help="the view's SQLite file (default: $FAUXMAD_VIEW, else a file per NATS URL under $XDG_CACHE_HOME/fauxmad)",
    show_default=False,
)


def shown(line: str) -> str:
    """A line of events as written to a pipe; on a terminal, its control characters visible (`render.visible`)."""
    return visible(line, keep="\t") if sys.stdout.isatty() else line


def note(message: str) -> None:
    sys.stderr.write(f"fauxmad: {message}\n")


def status(
    app: str | None = AppOption,
    watch: bool = typer.Option(False, "--watch", "-w", help="a live screen that follows the fleet (q quits)"),
    all_: bool = typer.Option(False, "--all", help="include destroyed machines"),
    view: Path | None = ViewOption,
    rebuild: bool = typer.Option(False, "--rebuild", help="forget the view and rebuild it from the stream"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> int:
    """Regions, workers and machines, from the systemwide view (no worker is asked)."""
    from orchestrator.view.paths import default_view_path

    url = nats_url(nats)
    assert url is not None
    path = view or default_view_path(url)
    if watch:
        if json_out:
            fail("--watch draws a screen; --json prints once: use one or the other", 2)
        from orchestrator.cli.live import watch as live_watch

        return serve(live_watch(url, path, app, console), what="status --watch") or 0
    result = run(_collect(url, path, app, all_, rebuild))
    snap = result.snapshot
    if result.rebuilt:
        note(f"view rebuilt from the stream: {result.rebuilt}")
    if not result.caught_up:
        note(f"the view did not catch up with the stream within {CATCH_UP_TIMEOUT:g}s: it may be behind")
    if app is not None and not result.known:
        fail(f"no app {app!r} in the view: nothing has ever run under that name", EXIT_NOT_FOUND)
    if json_out:
        print_json({**snap.status_json(str(path)), "jobs": result.jobs})
        return 0
    if snap.regions:
        console.print(regions_table(snap.regions))
    elif app is None:
        console.print("no regions: no worker has reported")
    if snap.workers:
        console.print(workers_table(snap.workers, time.time()))
    console.print(machines_table(snap.machines) if snap.machines else "no machines" + (f" in app {app}" if app else ""))
    if result.jobs:
        console.print(jobs_table(result.jobs))
    return 0


def jobs_table(counts: list[JobCount]) -> Table:
    """Background jobs by app and region: how many in each state (docs/how-to/jobs.md)."""
    from orchestrator.cli.render import KEYS, FitTable

    states = ("queued", "running", "succeeded", "failed", "cancelled")
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for count in counts:
        rows.setdefault((count.app, count.region), {})[count.state] = count.count
    from rich import box

    table = FitTable(title="jobs", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    for column in ("app", "region", *states):  # lower case, as every table
        table.add_column(column, no_wrap=column in KEYS, overflow="fold")  # app names are never cut
    for (app_name, region), by_state in sorted(rows.items()):
        table.add_row(app_name, region, *(str(by_state.get(state, 0)) for state in states))
    return table


class Collected(msgspec.Struct, frozen=True):
    snapshot: Snapshot
    caught_up: bool
    known: bool  # the app (if one was asked for) has ever had an event
    rebuilt: str | None
    jobs: list[JobCount] = []  # background jobs by app, region and state


async def _collect(url: str, path: Path, app: str | None, include_destroyed: bool, rebuild: bool) -> Collected:
    from orchestrator.view.follower import followed

    async with followed(url, path, name="fauxmad-status", rebuild=rebuild) as (follower, view):
        caught_up = await follower.catch_up(CATCH_UP_TIMEOUT)
        snap = view.snapshot(time.time(), app=app, include_destroyed=include_destroyed, events=0)
        known = app is None or view.known_app(app)
        rebuilt = follower.rebuilt or ("asked for (--rebuild)" if rebuild else None)
        jobs = await _job_counts(url, app)
        return Collected(snapshot=snap, caught_up=caught_up, known=known or bool(jobs), rebuilt=rebuilt, jobs=jobs)


async def _job_counts(url: str, app: str | None) -> list[JobCount]:
    from orchestrator.client import FleetClient
    from orchestrator.jobs.view import job_counts

    client = await FleetClient.connect(url, "fauxmad-status")
    try:
        return await job_counts(client.nc, app)
    finally:
        await client.close()


def _emit_job_event(json_out: bool) -> Callable[[int, JobEvent], None]:
    from datetime import datetime

    def emit(stream_seq: int, event: JobEvent) -> None:
        if json_out:
            line = msgspec.json.encode({**msgspec.structs.asdict(event), "stream_seq": stream_seq}).decode()
        else:
            at = datetime.fromtimestamp(event.at).strftime("%H:%M:%S.%f")[:-3]
            where = f"{event.region}/{event.worker_id or '-'}"
            line = f"{at}  {stream_seq:>6}  {where}  {event.app}  {event.id}  {event.state}  #{event.attempt}"
            line = shown(line + f"  {event.reason}")
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    return emit


def events(
    app: str | None = typer.Option(None, "--app", "-a", help="only this app's events", callback=check_app),
    machine: str | None = typer.Option(
        None, "--machine", "-m", help="only this machine's events", callback=check_machine_id
    ),
    since: str | None = typer.Option(None, "--since", help=f"start at: {SINCE_HELP}"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing events as they happen (Ctrl-C stops)"),
    jobs: bool = typer.Option(False, "--jobs", help="background jobs' state changes (stream FAUXMAD_JOB_EVENTS)"),
    nats: str | None = NatsOption,
    json_out: bool = typer.Option(False, "--json", help="one JSON object per line"),
) -> int:
    """Machine events from the stream FAUXMAD_EVENTS (with --jobs: job events), oldest first."""
    from bus.contract.machines import MachineEvent
    from orchestrator.client import FleetClient

    start = None
    if since is not None:
        try:
            start = parse_since(since, time.time())
        except ValueError as exc:
            fail(str(exc), 2)

    def emit(stream_seq: int, event: MachineEvent) -> None:
        if json_out:
            line = msgspec.json.encode({**msgspec.structs.asdict(event), "stream_seq": stream_seq}).decode()
        else:
            line = shown(event_line(stream_seq, event))
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    query = EventQuery(app=app, machine_id=machine, since=start, follow=follow)

    async def read(client: FleetClient) -> int:
        if jobs:
            from orchestrator.jobs.view import read_job_events

            return await read_job_events(client.nc, app, start, follow, _emit_job_event(json_out))
        return await client.events(query, emit)

    count = 0
    if follow:  # until Ctrl-C: stopped as every long-running command is, within STOP_WITHIN of the signal
        count = serve_client(nats, read, name="fauxmad-events", what="events --follow") or 0
    else:
        with contextlib.suppress(KeyboardInterrupt):
            count = with_client(nats, read, name="fauxmad-events")
    if count == 0 and app is not None:  # no events: is it an app the fleet does not know?
        from orchestrator.cli.names import require_app

        with_client(nats, lambda client: require_app(client, app))
    if count == 0 and not follow:
        scope = " ".join(filter(None, [f"app {app}" if app else "", f"machine {machine}" if machine else ""]))
        note("no events" + (f" for {scope}" if scope else "") + (f" since {since}" if since else ""))
    return 0
