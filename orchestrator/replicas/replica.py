"""A local replica of a KV bucket, kept current by a watch: the pattern behind `workers` and `machines`.

Brokers and reconcilers answer hot-path questions (who is alive in a region, which worker owns a
machine) from memory. A watch delivers the bucket's current values, then every put and every delete
or expiry marker; subclasses say what one update means by implementing `apply`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any


class KVReplica:
    def __init__(self) -> None:
        self._kv: Any = None
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.on_change: Callable[[str], None] | None = None  # called with the key after each update

    def apply(self, key: str, value: bytes | None) -> None:
        """One update; `value=None`: the key was deleted or expired."""
        raise NotImplementedError

    async def start(self, kv: Any, timeout: float = 5.0) -> None:
        """Watch `kv` and return once its current values are in (or after `timeout`)."""
        self._kv = kv
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._follow())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)

    async def _follow(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # the initial values are all in
                self._ready.set()
                continue
            self.apply(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
            if self.on_change is not None:
                self.on_change(entry.key)

    async def close(self) -> None:
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
