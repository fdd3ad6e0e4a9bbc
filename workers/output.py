"""Publishes machines' stdout/stderr lines on `fauxmad.v1.logs.<app>.<machine>`.

The workload writes straight to its log files (no pipe to the worker, so it survives the worker's
death and never blocks on it); this follows the files and publishes whole lines with a core publish
each, which stream `FAUXMAD_LOGS` stores (a JetStream publish per line would wait for an ack per
line). It reads every quarter second and only from files that grew, which costs a `stat` per
started machine.

The files are the buffer, so nothing is held in memory for long:
- While the bus is unreachable (`connected()` false) nothing is read; the lines wait in the files
  and go out after the outage. If a publish fails anyway, the streams go back to the first line not
  published and that line is read again on the next tick.
- A stream more than `MAX_BACKLOG` behind (a machine writing faster than the bus takes, or a long
  outage) jumps ahead to the last `MAX_BACKLOG` bytes, and says so in a line of its own
  (`[fauxmad] skipped N bytes of stdout`): late lines are bounded, and so is the flood after an outage.
- Where each stream stopped is kept in `<workdir>/logs.offsets` (at most once a second, and when a
  machine is no longer followed), so a restarted worker carries on where it stopped instead of
  skipping what its machines wrote meanwhile (a crash may publish up to a second of lines twice).
- A machine that stops is followed until its files are read to the end, its last line included
  even without a newline; lines it printed just before exiting are not lost.

A line is clipped to `MAX_LINE` bytes (at a character boundary) and gets the suffix
`… [clipped N bytes]`; the rest of it is not read into memory. Bytes that are not UTF-8 become U+FFFD.
A line's `timestamp` is when it was read: within a quarter second of being written, later after an
outage. Within one read, a machine's stdout lines come before its stderr lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from bus.contract.streams import LogLine

log = logging.getLogger(__name__)

MAX_LINE = 16 * 1024  # bytes of one line kept (bus/transport/jetstream.py sizes the stream's max message on it)
READ_CHUNK = 64 * 1024  # bytes read from one stream at a time (about 1,000 lines: a few ms of work)
READS_PER_TICK = 16  # so at most 1 MiB per stream per tick, 4 MiB/s
MAX_BACKLOG = 8 * 1024 * 1024  # at most this much of a stream is published late
OFFSETS_FILE = "logs.offsets"
SAVE_EVERY = 1.0  # seconds between saves of a followed machine's offsets
YIELD_EVERY = 256  # lines published between yields to the event loop (the worker answers auctions on it)

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr")


class _Pending:
    """One line read but not yet published, and where in its file it began."""

    __slots__ = ("line", "start", "stream")

    def __init__(self, stream: Stream, start: int, line: LogLine) -> None:
        self.stream = stream
        self.start = start
        self.line = line


class _File:
    """Where one stream of one machine stands."""

    __slots__ = ("discard", "dropped", "line", "line_start", "offset")

    def __init__(self, offset: int) -> None:
        self.reset(offset)

    def reset(self, offset: int) -> None:
        self.offset = offset  # bytes read
        self.line_start = offset  # where the line being read began: published up to here
        self.line = bytearray()  # its first MAX_LINE bytes
        self.dropped = 0  # its bytes beyond those
        self.discard = False  # reading the rest of a line jumped into: drop it

    def add(self, data: bytes) -> None:
        room = MAX_LINE - len(self.line)
        if room > 0:
            self.line += data[:room]
        self.dropped += max(0, len(data) - max(room, 0))


class _Followed:
    __slots__ = ("app", "closing", "files", "machine_id", "saved", "saved_at", "workdir")

    def __init__(self, machine_id: str, app: str, workdir: Path, offsets: dict[str, int]) -> None:
        self.machine_id = machine_id
        self.app = app
        self.workdir = workdir
        self.files = {stream: _File(offsets.get(stream, 0)) for stream in STREAMS}
        self.closing = False  # no longer followed: read to the end, then forgotten
        self.saved = dict(offsets)
        self.saved_at = time.monotonic()

    def position(self) -> dict[str, int]:
        return {stream: self.files[stream].line_start for stream in STREAMS}


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _start_offsets(workdir: Path, from_start: bool) -> dict[str, int]:
    """Where to begin: the saved offsets, else the start (`from_start`) or the current end of the files."""
    sizes: dict[str, int] = {stream: _size(workdir / f"{stream}.log") or 0 for stream in STREAMS}
    if from_start:
        return dict.fromkeys(STREAMS, 0)
    try:
        saved = json.loads((workdir / OFFSETS_FILE).read_text())
        # a file smaller than its offset was replaced: read it from the start
        return {s: int(saved[s]) if int(saved[s]) <= sizes[s] else 0 for s in STREAMS}
    except (OSError, ValueError, KeyError, TypeError):
        return sizes


def _text(raw: bytes | bytearray, dropped: int) -> str:
    text = raw.decode("utf-8", "replace")
    if dropped:
        if text.endswith("\ufffd"):  # a character cut in two by the clip
            text = text[:-1]
        text += f"… [clipped {dropped} bytes]"
    return text


class LogFollower:
    def __init__(
        self,
        publish: Callable[[LogLine], Awaitable[None]],
        *,
        region: str,
        worker_id: str,
        interval: float = 0.25,
        connected: Callable[[], bool] | None = None,
    ) -> None:
        self._publish = publish
        self._region = region
        self._worker_id = worker_id
        self._interval = interval
        self._connected = connected or (lambda: True)
        self._followed: dict[str, _Followed] = {}
        self._wanted = asyncio.Event()  # something is followed: `run` ticks only then

    def follow(self, machine_id: str, app: str, workdir: Path, *, from_offset_now: bool) -> None:
        """Follow a machine's files from where they were last read (else their end, or their start)."""
        followed = self._followed.get(machine_id)
        if followed is not None:
            followed.closing = False  # started again before its last lines were read: carry on
            return
        offsets = _start_offsets(workdir, from_start=not from_offset_now)
        self._followed[machine_id] = _Followed(machine_id, app, workdir, offsets)
        self._wanted.set()

    def unfollow(self, machine_id: str) -> None:
        """Stop following once what the machine wrote so far is published (on the next ticks)."""
        followed = self._followed.get(machine_id)
        if followed is not None:
            followed.closing = True

    def following(self) -> list[str]:
        return list(self._followed)

    async def run(self) -> None:
        """Tick every `interval` while anything is followed; with nothing followed, wait for a `follow` (no timer:
        a simulated fleet's idle workers each woke four times a second for nothing, issue 44)."""
        while True:
            if not self._followed:
                self._wanted.clear()
                await self._wanted.wait()
            await asyncio.sleep(self._interval)
            await self.tick()

    async def tick(self) -> int:
        """Read what the files gained and publish it; returns how many lines went out."""
        published = 0
        for followed in list(self._followed.values()):
            if not self._connected():
                break  # the lines wait in the files
            try:
                published += await self._publish_new(followed)
            except Exception:
                log.debug("log follow failed for %s", followed.machine_id, exc_info=True)
        return published

    async def _publish_new(self, followed: _Followed) -> int:
        """Read and publish in steps of `READ_CHUNK` per stream, yielding between them, up to
        `READS_PER_TICK` steps (a machine writing faster falls behind, up to `MAX_BACKLOG`)."""
        published = 0
        for _ in range(READS_PER_TICK):
            if not self._connected():
                break
            final = followed.closing
            pending, at_end = self._read(followed, final=final)
            sent = await self._send(followed, pending)
            published += sent
            if sent < len(pending):
                return published  # the bus refused a line: the rest waits for the next tick
            if at_end:
                if final and followed.closing:  # read to the end after it stopped: done with it
                    self._followed.pop(followed.machine_id, None)
                    self._save(followed, force=True)
                    return published
                break
            await asyncio.sleep(0)
        self._save(followed, force=False)
        return published

    async def _send(self, followed: _Followed, pending: list[_Pending]) -> int:
        for index, item in enumerate(pending):
            try:
                await self._publish(item.line)
            except Exception:
                # back to the first line of each stream that did not go out: read again next tick
                for stream in STREAMS:
                    first = next((p for p in pending[index:] if p.stream == stream), None)
                    if first is not None:
                        followed.files[stream].reset(first.start)
                log.debug("log publish failed for %s", followed.machine_id, exc_info=True)
                return index
            if index % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
        return len(pending)

    def _save(self, followed: _Followed, *, force: bool) -> None:
        position = followed.position()
        now = time.monotonic()
        if position == followed.saved or (not force and now - followed.saved_at < SAVE_EVERY):
            return
        path = followed.workdir / OFFSETS_FILE
        try:
            tmp = path.with_name(OFFSETS_FILE + ".tmp")
            tmp.write_text(json.dumps(position))
            os.replace(tmp, path)
        except OSError:  # the workdir is gone (destroyed): nothing to resume
            log.debug("could not save log offsets of %s", followed.machine_id, exc_info=True)
        followed.saved, followed.saved_at = position, now

    def _read(self, followed: _Followed, *, final: bool) -> tuple[list[_Pending], bool]:
        """The lines the files gained since the last read; `final`: the last one even without a newline.

        Returns the lines and whether every file was read to its end.
        """
        pending: list[_Pending] = []
        at_end = True
        now = time.time()

        def emit(stream: Stream, start: int, text: str) -> None:
            line = LogLine(
                machine_id=followed.machine_id,
                app=followed.app,
                stream=stream,
                line=text,
                timestamp=now,
                region=self._region,
                worker_id=self._worker_id,
            )
            pending.append(_Pending(stream, start, line))

        for stream in STREAMS:
            state = followed.files[stream]
            path = followed.workdir / f"{stream}.log"
            size = _size(path)
            if size is None:
                continue
            if size < state.offset:  # truncated or replaced
                state.reset(0)
            if size - state.offset > MAX_BACKLOG:
                skip = size - MAX_BACKLOG - state.offset
                emit(stream, state.line_start, f"[fauxmad] skipped {skip} bytes of {stream}")
                state.reset(state.offset + skip)
                state.discard = True  # the bytes up to the next newline are the end of a skipped line
            if size > state.offset:
                with path.open("rb") as handle:
                    handle.seek(state.offset)
                    chunk = handle.read(min(size - state.offset, READ_CHUNK))

                def line(start: int, raw: bytes | bytearray, dropped: int, stream: Stream = stream) -> None:
                    emit(stream, start, _text(raw, dropped))

                self._split(state, chunk, line)
            if state.offset < size:
                at_end = False
            elif final and (state.line or state.dropped) and not state.discard:
                emit(stream, state.line_start, _text(state.line, state.dropped))
                state.reset(state.offset)
        return pending, at_end

    @staticmethod
    def _split(state: _File, chunk: bytes, emit: Callable[[int, bytes | bytearray, int], None]) -> None:
        """Cut `chunk` (read at `state.offset`) into lines, keeping the first MAX_LINE bytes of each."""
        parts = chunk.split(b"\n")
        tail = parts.pop()  # after the last newline: the beginning of a line still being written
        pos = state.offset
        for part in parts:
            if state.discard:
                state.discard = False
            elif state.line or state.dropped:  # the end of the line being read
                state.add(part)
                emit(state.line_start, state.line, state.dropped)
                state.line, state.dropped = bytearray(), 0
            else:
                emit(pos, part[:MAX_LINE], max(0, len(part) - MAX_LINE))
            pos += len(part) + 1
            state.line_start = pos
        if tail and not state.discard:
            state.add(tail)
        state.offset = pos + len(tail)
