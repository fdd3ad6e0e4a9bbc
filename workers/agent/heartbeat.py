"""The worker's heartbeat: `WorkerInfo` into KV `fauxmad_workers` every `heartbeat_interval`.

The bucket's TTL makes a dead worker's key expire, so the beat is how the registry knows the worker is
alive, and its numbers are what the brokers place volumes from. Between ticks, a change of usage beats
soon (coalesced, unacknowledged) rather than at the next tick. Each beat measures the host's load,
which offers carry too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.fleet import WorkerInfo
from bus.transport.jetstream import FleetKV

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        nc: Client,
        kv: FleetKV,
        *,
        region: str,
        worker_id: str,
        interval: float,
        info: Callable[[], WorkerInfo],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.nc = nc
        self.kv = kv
        self.region = region
        self.worker_id = worker_id
        self.interval = interval
        self.info = info
        self.spawn = spawn  # the agent's tasks: cancelled when it closes
        self.load = 0.0  # the host's load average per cpu, as of the last beat
        self._pending = False

    async def put(self, info: WorkerInfo, *, acked: bool = True) -> None:
        """Put `info` into the registry; `acked=False` only publishes it (in order with the acked puts,
        on the same connection), and not at all while disconnected: no stale beat is buffered."""
        key = subjects.worker_key(self.region, self.worker_id)
        if acked:
            await self.kv.workers.put(key, encode(info))
        elif self.nc.is_connected:
            bucket = self.kv.layout.workers_bucket(self.region)
            await self.nc.publish(subjects.kv_put(bucket, key), encode(info))

    async def once(self, *, acked: bool = True) -> None:
        try:
            self.load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
        except OSError:
            self.load = 0.0
        await self.put(self.info(), acked=acked)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.once()
            except Exception:
                log.warning("heartbeat failed", exc_info=True)

    def soon(self) -> None:
        """Usage changed: tell the registry now rather than at the next tick (coalesced).

        Best effort, so published without waiting for JetStream's ack: at the fleet's rates this beat
        follows nearly every reserve, and the ack's round trip cost about as much as the rest of the beat.
        The tick (every `heartbeat_interval`) still waits for its ack and says when puts fail.
        """
        if self._pending:
            return
        self._pending = True

        async def beat() -> None:
            await asyncio.sleep(0.05)
            self._pending = False
            with contextlib.suppress(Exception):
                await self.once(acked=False)

        self.spawn(beat())
