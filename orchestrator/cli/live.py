"""`fauxmad status --watch`: a rich Live screen that follows the view and redraws as events arrive.

The follower applies events as they come; each batch wakes the drawing loop, which redraws at
once unless it drew less than `MIN_INTERVAL` ago (bursts are coalesced, at most about six frames a
second), and otherwise once a second, which is when heartbeats (usage bars, lost workers) show. Keys are read from the
terminal in cbreak mode (`q` quits); Ctrl-C and SIGTERM quit too. The terminal is always restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.live import Live

from orchestrator.cli.view_render import layout
from orchestrator.view.follower import followed
from orchestrator.view.query import ViewReader

MIN_INTERVAL = 0.15  # seconds between two frames at most; a change waits no longer than this
IDLE_REDRAW = 1.0  # redraw at least this often
EVENTS_SHOWN = 30


@contextlib.contextmanager
def cbreak_keys(on_key: bytes, stop: asyncio.Event) -> Iterator[None]:
    """While inside: keys arrive one by one (no Enter needed); pressing one of `on_key` sets `stop`."""
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def read_key() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data or any(key in on_key for key in data):
            stop.set()

    tty.setcbreak(fd)
    loop.add_reader(fd, read_key)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def watch(url: str, view_path: Path, app: str | None, console: Console) -> int:
    """Run the live view until `q`, Ctrl-C or SIGTERM (exit 0), or until the bus is lost (exit 1)."""
    changed = asyncio.Event()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with followed(url, view_path, name="fauxmad-status-watch", on_change=changed.set) as (follower, view):
            with cbreak_keys(b"qQ", stop), Live(console=console, screen=True, auto_refresh=False) as live:
                await _draw_until(stop, changed, live, view, console, url, app, follower.nc)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if not stop.is_set():  # the drawing ended on its own: the connection closed
        console.print(f"fauxmad: lost the connection to NATS at {url}", style="red", highlight=False)
        return 1
    return 0


async def _draw_until(
    stop: asyncio.Event,
    changed: asyncio.Event,
    live: Live,
    view: ViewReader,
    console: Console,
    url: str,
    app: str | None,
    nc: object,
) -> None:
    stopping = asyncio.create_task(stop.wait())
    try:
        while not stop.is_set() and not getattr(nc, "is_closed", False):
            changed.clear()
            snap = view.snapshot(time.time(), app=app, events=EVENTS_SHOWN, machines=False)
            live.update(layout(snap, width=console.width, height=console.height, source=url, app=app), refresh=True)
            drawn = time.monotonic()
            waking = asyncio.create_task(changed.wait())
            await asyncio.wait({stopping, waking}, timeout=IDLE_REDRAW, return_when=asyncio.FIRST_COMPLETED)
            waking.cancel()
            pause = MIN_INTERVAL - (time.monotonic() - drawn)
            if pause > 0 and not stop.is_set():
                await asyncio.wait({stopping}, timeout=pause)
    finally:
        stopping.cancel()
