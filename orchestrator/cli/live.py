"""`fauxmad status --watch`: a rich Live screen that follows the view and redraws as events arrive.

The follower applies events as they come; each batch wakes the drawing loop, which redraws at
once unless it drew less than `MIN_INTERVAL` ago (bursts are coalesced, at most about six frames a
second), and otherwise once a second, which is when heartbeats (usage bars, lost workers) show. Keys are read from the
terminal in cbreak mode (`q` quits) only while this process is in the terminal's foreground: in the background
(`timeout 5 fauxmad status --watch`, `&`) touching the terminal's settings or reading it would stop the process
(SIGTTOU, SIGTIN), so it only draws. Not on a terminal (a pipe, a file), it prints plain frames, one when the fleet
changed and at most every `PLAIN_INTERVAL` seconds. Ctrl-C and SIGTERM quit (the CLI's `serve` cancels the
watch); the terminal is always restored, also when the stop is forced.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console, RenderableType
from rich.live import Live

from orchestrator.cli.runtime import at_forced_exit
from orchestrator.cli.view_render import layout
from orchestrator.view.follower import followed

MIN_INTERVAL = 0.15  # seconds between two frames at most; a change waits no longer than this
IDLE_REDRAW = 1.0  # redraw at least this often
PLAIN_INTERVAL = 2.0  # not on a terminal: seconds between two printed frames at least
EVENTS_SHOWN = 30
_LEAVE_SCREEN = "\x1b[?1049l\x1b[?25h"  # the terminal's own screen back, and its cursor


def in_foreground(fd: int) -> bool:
    """Whether `fd` is a terminal whose foreground process group is this process's (it may set it up, read it)."""
    try:
        return os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


def _leave_screen() -> None:
    sys.stdout.write(_LEAVE_SCREEN)


@contextlib.contextmanager
def cbreak_keys(on_key: bytes, stop: asyncio.Event) -> Iterator[None]:
    """While inside: keys arrive one by one (no Enter needed); pressing one of `on_key` sets `stop`. Nothing
    happens unless stdin is a terminal this process has in the foreground (see the module's docstring)."""
    if not in_foreground(sys.stdin.fileno()):
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def read_key() -> None:
        if not in_foreground(fd):  # sent to the background meanwhile: reading would stop the process
            return
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data or any(key in on_key for key in data):
            stop.set()

    def restore() -> None:
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)

    tty.setcbreak(fd)
    at_forced_exit(restore)
    loop.add_reader(fd, read_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        if in_foreground(fd):
            restore()


async def watch(url: str, view_path: Path, app: str | None, console: Console) -> int:
    """Run the live view until `q` (exit 0) or until the bus is lost (exit 1); SIGINT and SIGTERM cancel it."""
    changed = asyncio.Event()
    stop = asyncio.Event()
    async with followed(url, view_path, name="fauxmad-status-watch", on_change=changed.set, reconnect_forever=True) as (
        follower,
        view,
    ):

        def frame() -> RenderableType:
            snap = view.snapshot(time.time(), app=app, events=EVENTS_SHOWN, machines=False)
            return layout(snap, width=console.width, height=console.height, source=url, app=app)

        if console.is_terminal:
            at_forced_exit(_leave_screen)
            with cbreak_keys(b"qQ", stop), Live(console=console, screen=True, auto_refresh=False) as live:
                await _draw_until(stop, changed, lambda: live.update(frame(), refresh=True), follower.nc)
        else:
            await _draw_until(stop, changed, lambda: console.print(frame()), follower.nc, plain=True)
    if not stop.is_set():  # the drawing ended on its own: the connection closed
        console.print(f"fauxmad: lost the connection to NATS at {url}", style="red", highlight=False)
        return 1
    return 0


async def _draw_until(
    stop: asyncio.Event, changed: asyncio.Event, draw: Callable[[], None], nc: object, *, plain: bool = False
) -> None:
    """Draw, then again on a change (after `MIN_INTERVAL`) or every `IDLE_REDRAW`; `plain`: only on a change, at
    most every `PLAIN_INTERVAL`. Until `stop` is set or the connection closed for good."""
    interval = PLAIN_INTERVAL if plain else MIN_INTERVAL
    stopping = asyncio.create_task(stop.wait())
    drawn = -interval
    try:
        first = True
        while not stop.is_set() and not getattr(nc, "is_closed", False):
            if first or changed.is_set() or not plain:
                first = False
                changed.clear()
                draw()
                drawn = time.monotonic()
            waking = asyncio.create_task(changed.wait())
            await asyncio.wait({stopping, waking}, timeout=IDLE_REDRAW, return_when=asyncio.FIRST_COMPLETED)
            waking.cancel()
            pause = interval - (time.monotonic() - drawn)
            if pause > 0 and not stop.is_set():
                await asyncio.wait({stopping}, timeout=pause)
    finally:
        stopping.cancel()
