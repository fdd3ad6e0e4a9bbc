"""Publishes machines' stdout/stderr lines on `fauxmad.v1.logs.<app>.<machine>`.

The workload writes straight to its log files (no pipe to the worker, so it survives the worker's
death and never blocks on it); this follows the files and publishes whole lines. It reads every
quarter second and only from files that grew, which costs a `stat` per started machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.messages import LogLine

log = logging.getLogger(__name__)

MAX_LINE = 16 * 1024


class _Followed:
    __slots__ = ("app", "machine_id", "offsets", "partial", "workdir")

    def __init__(self, machine_id: str, app: str, workdir: Path, from_start: bool) -> None:
        self.machine_id = machine_id
        self.app = app
        self.workdir = workdir
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {"stdout": b"", "stderr": b""}
        for stream in ("stdout", "stderr"):
            path = workdir / f"{stream}.log"
            self.offsets[stream] = 0 if from_start or not path.exists() else path.stat().st_size


class LogFollower:
    def __init__(
        self, publish: Callable[[LogLine], Awaitable[None]], *, region: str, worker_id: str, interval: float = 0.25
    ) -> None:
        self._publish = publish
        self._region = region
        self._worker_id = worker_id
        self._interval = interval
        self._followed: dict[str, _Followed] = {}

    def follow(self, machine_id: str, app: str, workdir: Path, *, from_offset_now: bool) -> None:
        if machine_id not in self._followed:
            self._followed[machine_id] = _Followed(machine_id, app, workdir, from_start=not from_offset_now)

    def unfollow(self, machine_id: str) -> None:
        followed = self._followed.pop(machine_id, None)
        if followed is not None:
            with contextlib.suppress(Exception):
                self._drain(followed)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            for followed in list(self._followed.values()):
                try:
                    for line in self._drain(followed):
                        await self._publish(line)
                except Exception:
                    log.debug("log follow failed for %s", followed.machine_id, exc_info=True)

    def _drain(self, followed: _Followed) -> list[LogLine]:
        lines: list[LogLine] = []
        now = time.time()
        for stream in ("stdout", "stderr"):
            path = followed.workdir / f"{stream}.log"
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            offset = followed.offsets[stream]
            if size < offset:  # truncated or replaced
                offset = 0
            if size == offset:
                continue
            with path.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read(min(size - offset, 1024 * 1024))
            followed.offsets[stream] = offset + len(chunk)
            data = followed.partial[stream] + chunk
            *complete, rest = data.split(b"\n")
            followed.partial[stream] = rest[-MAX_LINE:]
            for raw in complete:
                lines.append(
                    LogLine(
                        machine_id=followed.machine_id,
                        app=followed.app,
                        stream=stream,  # type: ignore[arg-type]
                        line=raw[:MAX_LINE].decode("utf-8", "replace"),
                        timestamp=now,
                        region=self._region,
                        worker_id=self._worker_id,
                    )
                )
        return lines
