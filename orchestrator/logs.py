"""Machine logs from stream FAUXMAD_LOGS: the history, then (when asked) what comes next.

Workers publish each stdout/stderr line on `fauxmad.v1.logs.<app>.<machine>`; the stream keeps them
within its limits (bus/transport/jetstream.py). This reads them for `fauxmad logs` and `fauxmad machine logs`:

- The history is read oldest first, filtered on the server by subject (app, machine), from
  `since` and/or the last `lines` lines, and ends at the last line stored when the read began.
  The last N lines are found without reading what came before: a binary search on the start
  sequence, asking the server how many lines match from there (a consumer's `num_pending`).
- A region is not in the subject (the contract subject is kept), but a machine never changes
  region: the history of a region is that of the app's machines whose last stored line names the
  region, so it is filtered on the server too, and "the last N lines" stay exact. Following
  filters on the region of each line instead, so machines that start later are seen.
- Following starts right after the history's last line: nothing in between is lost or shown twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import msgspec

from bus.contract import subjects
from bus.contract.streams import LogLine
from bus.transport.jetstream import ensure_logs_stream
from bus.transport.nats_adapter import AckPolicy, ConsumerConfig, DeliverPolicy, JetStream, Msg, Nats, NotFoundError

DEFAULT_LINES = 100  # history shown when neither `since` nor `lines` is given

_decode = msgspec.json.Decoder(LogLine)


class LogQuery(msgspec.Struct, frozen=True, kw_only=True):
    """What to read. `app`/`machine_id` `None`: any. `lines`: at most the last N lines of the history
    (`None`: all of it from `since`, or `DEFAULT_LINES` without `since`; 0: none)."""

    app: str | None = None
    machine_id: str | None = None
    region: str | None = None
    since: float | None = None  # epoch seconds, matched against the time the stream stored a line
    lines: int | None = None
    follow: bool = False

    def history_lines(self) -> int | None:
        if self.lines is not None:
            return self.lines
        return None if self.since is not None else DEFAULT_LINES


class LogRecord(msgspec.Struct, frozen=True):
    stream_seq: int
    line: LogLine


Emit = Callable[[Sequence[LogRecord]], None]


async def read_logs(nc: Nats, query: LogQuery, emit: Emit, *, now: float | None = None) -> int:
    """Call `emit` with batches of matching lines, oldest first; returns how many.

    Without `follow` it returns at the end of the history; with it, it runs until cancelled.
    """
    js = nc.jetstream()
    await ensure_logs_stream(js)
    state = (await js.stream_info(subjects.LOGS_STREAM)).state
    end = state.last_seq if state.messages else 0
    broad = subjects.logs_filter(query.app, query.machine_id)
    count = 0
    wanted = query.history_lines()
    if end and wanted != 0 and not (query.since is not None and query.since >= (time.time() if now is None else now)):
        filters = [broad]
        if query.region and not query.machine_id:
            filters = await region_subjects(js, broad, query.region)
        if filters:
            start = await _history_start(js, filters, query.since, wanted, state.first_seq, end)
            if start is not None:
                count += await _read(js, filters, start, query.region, emit, end=end)
    if query.follow:
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=end + 1)
        count += await _read(js, [broad], config, query.region, emit, end=None)
    return count


async def region_subjects(js: JetStream, broad: str, region: str) -> list[str]:
    """The subjects under `broad` (one per machine) whose last stored line was published in `region`."""
    info = await js.stream_info(subjects.LOGS_STREAM, subjects_filter=broad)
    found = sorted((info.state.subjects or {}).keys())
    gate = asyncio.Semaphore(32)

    async def in_region(subject: str) -> bool:
        async with gate:
            try:
                msg = await js.get_last_msg(subjects.LOGS_STREAM, subject)
            except NotFoundError:  # aged out meanwhile
                return False
        line = _line(msg.data or b"")
        return line is not None and line.region == region

    keep = await asyncio.gather(*(in_region(subject) for subject in found))
    return [subject for subject, kept in zip(found, keep, strict=True) if kept]


async def has_lines(nc: Nats, app: str, machine_id: str) -> bool:
    """Whether the stream holds any line of this machine (a destroyed machine's logs outlive it)."""
    js = nc.jetstream()
    await ensure_logs_stream(js)
    try:
        await js.get_last_msg(subjects.LOGS_STREAM, subjects.logs_filter(app, machine_id))
    except NotFoundError:
        return False
    return True


def _filtered(config: ConsumerConfig, filters: list[str]) -> ConsumerConfig:
    if len(filters) == 1:
        config.filter_subject = filters[0]
    else:
        config.filter_subjects = list(filters)
    return config


def _from_since(since: float | None) -> ConsumerConfig:
    if since is None:
        return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=datetime.fromtimestamp(since, UTC))


def _from_seq(seq: int) -> ConsumerConfig:
    return ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq)


async def _pending(js: JetStream, filters: list[str], config: ConsumerConfig) -> int:
    """How many stored lines match `filters` from `config`'s start (a consumer that is never read)."""
    config = _filtered(config, filters)
    config.ack_policy = AckPolicy.NONE
    config.mem_storage = True
    config.inactive_threshold = 30.0  # cleaned up by the server even if the delete below is lost
    info = await js.add_consumer(subjects.LOGS_STREAM, config)
    with contextlib.suppress(Exception):
        await js.delete_consumer(subjects.LOGS_STREAM, info.name)
    return info.num_pending or 0


async def _history_start(
    js: JetStream, filters: list[str], since: float | None, lines: int | None, first: int, end: int
) -> ConsumerConfig | None:
    """Where the history begins: at `since` (or the start), moved up to the last `lines` lines.

    `None` when nothing matches.
    """
    start = _from_since(since)
    matching = await _pending(js, filters, _from_since(since))
    if matching == 0:
        return None
    if lines is None or matching <= lines:
        return start
    # the latest sequence from which at least `lines` lines match (pending only shrinks as it grows)
    low, high = max(first, 1), end
    while low < high:
        mid = (low + high + 1) // 2
        if await _pending(js, filters, _from_seq(mid)) >= lines:
            low = mid
        else:
            high = mid - 1
    return _from_seq(low)


async def _read(
    js: JetStream, filters: list[str], config: ConsumerConfig, region: str | None, emit: Emit, *, end: int | None
) -> int:
    """Read from `config`'s start, up to stream sequence `end` (`None`: until cancelled)."""
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        queue.put_nowait(msg)

    sub = await js.subscribe(
        filters[0],
        stream=subjects.LOGS_STREAM,
        cb=on_msg,
        ordered_consumer=True,
        config=_filtered(config, filters),
    )
    count = 0
    try:
        if end is not None:
            info = await sub.consumer_info()
            delivered = info.delivered.consumer_seq if info.delivered else 0
            if info.num_pending == 0 and delivered == 0 and queue.empty():
                return 0
        while True:
            batch: list[LogRecord] = []
            done = False
            msg = await queue.get()
            while True:
                seq, pending = _position(msg)
                if end is not None and seq > end:
                    done = True
                    break
                line = _line(msg.data)
                if line is not None and (region is None or line.region == region):
                    batch.append(LogRecord(seq, line))
                if end is not None and (seq >= end or pending == 0):
                    done = True
                    break
                if queue.empty() or len(batch) >= 1000:
                    break
                msg = queue.get_nowait()
            if batch:
                emit(batch)
                count += len(batch)
            if done:
                return count
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def _position(msg: Msg) -> tuple[int, int]:
    """The stream sequence of a delivered message and how many more match (`msg.metadata`, quicker)."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>
        return int(tokens[5]), int(tokens[8])
    meta = msg.metadata  # the longer form (with a domain and an account): let nats-py read it
    return meta.sequence.stream, meta.num_pending


def _line(data: bytes) -> LogLine | None:
    try:
        return _decode.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # not a log line: something else published on the subject


@functools.lru_cache(maxsize=64)
def _second(whole: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))


def iso_time(timestamp: float) -> str:
    """`2024-05-01T12:00:00.123Z` (UTC, milliseconds), as `fauxmad events` prints times."""
    millis = int(timestamp * 1000)
    return f"{_second(millis // 1000)}.{millis % 1000:03d}Z"


def plain_line(record: LogRecord, *, with_app: bool = False) -> str:
    """`time region machine stream | line`, the line verbatim (no markup, nothing escaped)."""
    line = record.line
    who = f"{line.app} {line.machine_id}" if with_app else line.machine_id
    return f"{iso_time(line.timestamp)} {line.region or '-'} {who} {line.stream} | {line.line}"


def json_line(record: LogRecord) -> str:
    """The line as published, plus `stream_seq`."""
    return msgspec.json.encode({**msgspec.structs.asdict(record.line), "stream_seq": record.stream_seq}).decode()
