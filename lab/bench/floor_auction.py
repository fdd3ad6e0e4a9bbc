"""The floor's auction in plain nats-py: scatter an offer request, gather the answers, pick the most free.

Shared by the floor's client (`lab.bench.floor`, which runs the auction itself) and the floor's broker
(`lab.bench.floor_broker`, which runs it for clients, as fauxmad's brokers do). Imports nothing but the standard
library and nats-py, so that what it costs is the protocol's, under any implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random

from nats.aio.client import Client
from nats.aio.msg import Msg


class Gatherer:
    """One wildcard inbox per connection; a fresh reply subject per scatter (as fauxmad's Scatterer)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.waiting: dict[str, tuple[list[dict[str, object]], asyncio.Event, int]] = {}
        self.counter = 0

    async def start(self) -> None:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        entry = self.waiting.get(msg.subject)
        if entry is None:
            return
        replies, done, expected = entry
        replies.append(json.loads(msg.data))
        if len(replies) >= expected:
            done.set()

    async def scatter(self, subject: str, payload: bytes, expected: int, deadline: float) -> list[dict[str, object]]:
        self.counter += 1
        reply = f"{self.prefix}.{self.counter}"
        replies: list[dict[str, object]] = []
        done = asyncio.Event()
        self.waiting[reply] = (replies, done, expected)
        try:
            await self.nc.publish(subject, payload, reply=reply)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=deadline)
        finally:
            del self.waiting[reply]
        return list(replies)


def pick(offers: list[dict[str, object]], pending: dict[str, int], rng: random.Random) -> str | None:
    """The most free worker, less what this client has picked there and not heard back about; ties at random."""
    best: list[str] = []
    top = None
    for offer in offers:
        worker_id = str(offer["worker_id"])
        free = int(str(offer["free_cpus"])) - pending.get(worker_id, 0)
        if top is None or free > top:
            best, top = [worker_id], free
        elif free == top:
            best.append(worker_id)
    return rng.choice(best) if best else None


class FloorSubjects:
    """Where one floor talks, under its own namespace (`floor.v1` for the plain floor), so floors share a server."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def offers(self, region: str) -> str:
        return f"{self.namespace}.offers.{region}"

    def reserve(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}.machines.reserve"

    def create(self, region: str) -> str:
        """A create through the floor's broker (the floors that have one)."""
        return f"{self.namespace}.create.{region}"

    def events(self, worker_id: str) -> str:
        return f"{self.namespace}.events.{worker_id}"

    @property
    def index(self) -> str:
        """The routing index's subjects' prefix: one entry per machine, `<prefix>.<machine id>`."""
        return f"{self.namespace}.index"

    def audit(self, worker_id: str) -> str:
        return f"{self.namespace}.audit.{worker_id}"
