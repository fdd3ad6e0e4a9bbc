"""Event history straight from the stream: `fauxmad events`, with server-side filters.

The stream is the history; the view only caches it. Reading it directly means `events` works with
no view file, filters by app and machine on the server (the subject carries both), and starts at a
time (`--since`) without reading what came before. Without `--follow` it stops at the last event
that matched when it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from bus.contract import subjects
from bus.contract.base import seconds
from bus.contract.machines import MachineEvent
from bus.transport.jetstream import ensure_fleet_resources
from bus.transport.nats_adapter import ConsumerConfig, DeliverPolicy, Msg, Nats
from orchestrator.view.follower import decode_event

SINCE_HELP = "a duration back from now (30s, 10m, 2h, 1d) or an ISO 8601 time (2024-05-01T12:00:00Z; no zone: local)"


def parse_since(text: str, now: float) -> float:
    """`--since` as epoch seconds: `10m` means ten minutes before `now`; an ISO time means itself."""
    value = text.strip()
    try:
        return now - (float(value) if value.replace(".", "", 1).isdigit() else seconds(value))
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"invalid --since {text!r}: use {SINCE_HELP}") from None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # a time without a zone is the reader's local time
    return moment.timestamp()


def start_config(since: float | None, now: float) -> ConsumerConfig:
    if since is None:
        return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    if since >= now:  # nothing stored can match (and the server misreads times past the year 2262)
        return ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=datetime.fromtimestamp(since, UTC))


class EventQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Which events to read: `app`/`machine_id` `None`: any; from `since` (epoch seconds; `None`: the
    oldest kept); `follow`: then keep reading new ones."""

    app: str | None = None
    machine_id: str | None = None
    since: float | None = None
    follow: bool = False


EmitEvent = Callable[[int, MachineEvent], None]


async def read_events(nc: Nats, query: EventQuery, emit: EmitEvent) -> int:
    """Call `emit(stream_seq, event)` for each matching event, oldest first; returns how many."""
    await ensure_fleet_resources(nc.jetstream())

    def handle(stream_seq: int, data: bytes) -> bool:
        event = decode_event(data)
        if event is not None:
            emit(stream_seq, event)
        return event is not None

    subject = subjects.events_filter(query.app, query.machine_id)
    return await replay(nc, subjects.EVENTS_STREAM, subject, query.since, query.follow, handle)


async def replay(
    nc: Nats, stream: str, subject: str, since: float | None, follow: bool, handle: Callable[[int, bytes], bool]
) -> int:
    """Hand each stored message of `stream` matching `subject` to `handle(stream_seq, data)` (True: it counted),
    oldest first, from `since`; without `follow`, stop at the last one that matched when it started."""
    js = nc.jetstream()
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    sub = await js.subscribe(
        subject, stream=stream, cb=on_msg, ordered_consumer=True, config=start_config(since, time.time())
    )
    count = 0
    try:
        if not follow:
            info = await sub.consumer_info()
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if info.num_pending == 0 and delivered == 0 and queue.empty():
                return 0
        while True:
            msg = await queue.get()
            meta = msg.metadata
            if handle(meta.sequence.stream, msg.data):
                count += 1
            if not follow and meta.num_pending == 0:
                return count
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
