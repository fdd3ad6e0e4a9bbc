"""`fauxmad logs` and `fauxmad machine logs`: machines' stdout and stderr from stream FAUXMAD_LOGS.

App output is printed as written: plain writes to stdout, never through rich, so `[info]` or
`[/x]` in a line is printed as it is. On a terminal its control characters are shown as escapes
(`render.visible`: ESC as `\x1b`), as journalctl does, so a machine cannot set the window's title, write
the clipboard (OSC 52) or colour the screen; a pipe, `--json` and `--raw` get the exact text. A line is
`time region machine stream | line` (`--json`: one object per line, as published plus `stream_seq`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer

from orchestrator.cli.render import visible
from orchestrator.cli.runtime import (
    MachineAppOption,
    MachineIdArgument,
    NatsOption,
    check_app,
    check_machine_id,
    check_region,
    fail,
    with_client,
)
from orchestrator.logs import DEFAULT_LINES, LogQuery, LogRecord, json_line, plain_line
from orchestrator.view.history import SINCE_HELP, parse_since

if TYPE_CHECKING:
    from orchestrator.client import FleetClient

SinceOption = typer.Option(None, "--since", help=f"the history from: {SINCE_HELP}", show_default=False)
LinesOption = typer.Option(
    None,
    "--lines",
    "-n",
    min=0,
    help=f"at most the last N lines of the history (default: {DEFAULT_LINES}; with --since: all since)",
    show_default=False,
)
LogsJsonOption = typer.Option(False, "--json", help="one JSON object per line (the line as published, and stream_seq)")
RawOption = typer.Option(
    False, "--raw", help="the lines' bytes as written, on a terminal too (default there: control characters as \\x1b)"
)
# one habit for `logs` and `machine logs`: the history, then stop; -f follows (`--no-tail`, flyctl's, is the default)
FollowOption = typer.Option(
    False,
    "--follow/--no-follow",
    "-f/--no-tail",
    help="-f: after the history, keep printing new lines until Ctrl-C; default (--no-tail): the history, then stop",
)


def logs(
    app: str | None = typer.Option(
        None, "--app", "-a", help="this app's machines (default: every app)", callback=check_app
    ),
    machine: str | None = typer.Option(None, "--machine", "-m", help="only this machine", callback=check_machine_id),
    region: str | None = typer.Option(
        None, "--region", "-r", help="only machines in this region", callback=check_region
    ),
    since: str | None = SinceOption,
    lines: int | None = LinesOption,
    follow: bool = FollowOption,
    nats: str | None = NatsOption,
    json_out: bool = LogsJsonOption,
    raw: bool = RawOption,
) -> int:
    """Machines' stdout and stderr, oldest first: the last lines kept, then stop (-f: new ones as they come)."""
    query = LogQuery(app=app, machine_id=machine, region=region, since=_since(since), lines=lines, follow=follow)
    count = _print(nats, query, json_out=json_out, with_app=app is None, raw=raw)
    if count == 0 and (app is not None or region is not None):  # no lines: is it a name the fleet does not know?
        with_client(nats, functools.partial(_known, app, region))
    if count == 0 and not follow and lines != 0:
        scope = " ".join(
            filter(
                None,
                [
                    f"app {app}" if app else "",
                    f"machine {machine}" if machine else "",
                    f"region {region}" if region else "",
                ],
            )
        )
        _note("no logs" + (f" for {scope}" if scope else "") + (f" since {since}" if since else ""))
    return 0


def machine_logs(
    machine_id: str = MachineIdArgument,
    app: str = MachineAppOption,
    follow: bool = FollowOption,
    since: str | None = SinceOption,
    lines: int | None = LinesOption,
    nats: str | None = NatsOption,
    json_out: bool = LogsJsonOption,
    raw: bool = RawOption,
) -> int:
    """A machine's stdout and stderr: its last lines kept, then stop (-f: new ones as they come), as `fauxmad logs`."""
    query = LogQuery(app=app, machine_id=machine_id, since=_since(since), lines=lines, follow=follow)
    count = _print(nats, query, json_out=json_out, with_app=False, must_exist=True, raw=raw)
    if count == 0 and not follow and lines != 0:
        _note(f"no logs for machine {machine_id}" + (f" since {since}" if since else ""))
    return 0


async def _known(app: str | None, region: str | None, client: FleetClient) -> None:
    """Nothing if the fleet knows `app` and `region`, else exit 4 with the closest names (`names`)."""
    from orchestrator.cli.names import require_app, require_regions

    if app is not None:
        await require_app(client, app)
    if region is not None:
        await require_regions(client, [region])


def _since(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_since(text, time.time())
    except ValueError as exc:
        fail(str(exc), 2)


def _note(message: str) -> None:
    sys.stderr.write(f"fauxmad: {message}\n")


def _write(batch: Sequence[LogRecord], *, json_out: bool, with_app: bool, escape: bool) -> None:
    """`escape`: control characters as escapes (a terminal's, without --raw); a line's tabs are kept."""
    lines = (json_line(r) if json_out else plain_line(r, with_app=with_app) for r in batch)
    text = "".join((visible(line, keep="\t") if escape else line) + "\n" for line in lines)
    out = sys.stdout
    buffer = getattr(out, "buffer", None)
    if buffer is None:
        out.write(text)
    else:  # bytes: whatever the terminal's encoding, a line is never refused
        out.flush()
        buffer.write(text.encode("utf-8", "replace"))
    out.flush()


def _print(
    url: str | None, query: LogQuery, *, json_out: bool, with_app: bool, must_exist: bool = False, raw: bool = False
) -> int:
    """Print what `query` matches; returns how many lines."""
    from orchestrator.client import ConnectionLost

    escape = not (json_out or raw) and sys.stdout.isatty()

    async def read(client: FleetClient) -> int:
        emit = functools.partial(_write, json_out=json_out, with_app=with_app, escape=escape)
        try:
            return await client.logs(query, emit, must_exist=must_exist)
        except ConnectionLost as exc:
            fail(str(exc))

    try:
        with contextlib.suppress(KeyboardInterrupt):
            return with_client(url, read, name="fauxmad-logs")
        return 0
    except BrokenPipeError:  # `fauxmad logs | head`: the reader has seen enough
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
