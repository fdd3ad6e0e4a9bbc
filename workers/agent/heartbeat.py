"""The worker's heartbeat: `WorkerInfo` into KV `fauxmad_workers` every `heartbeat_interval`.

The bucket's TTL makes a dead worker's key expire, so the beat is how the registry knows the worker is
alive, and its numbers are what the brokers place volumes from. Between ticks, a change of usage beats
soon (coalesced, unacknowledged) rather than at the next tick: a volume's within 50 ms, a machine's within a
quarter of the interval (`USAGE_SHARE`, below). Each beat measures the host's load, which offers carry too.

Why a machine's change may wait a quarter of the interval (issue 44): placement by `scatter`, `p2c` and `hedged`
reads no heartbeat's usage, since every offer carries the worker's numbers as they are when it answers. What reads
it: strategy `replica` (it ranks heartbeats, each broker discounting its own picks until a heartbeat stamped half
a second after a reserve shows it, `orchestrator.placement.picks`, so only another broker's picks wait for the
beat), the HTTP API's placements estimate and app counts, and what people read (`fauxmad workers`, status, the
console). None needs the number within 50 ms, and the worker's reserve re-checks room whatever a broker read. At
50 ms a worker sent about 0.65 beats a reserve at concurrency 1 (a put nats-server stores and every broker and
watcher decodes); a quarter of a second bounds that at 4 a second, whatever the rate of creates.

It also tells the worker when it was away: a gap between acknowledged beats longer than `away_after` (the
registry's TTL less a beat, so before any broker can have counted the worker gone) is an absence, after which
the worker asks the claims of its keyed machines (the fence, workers/lifecycle/fence.py).

The logical workers of one process (`fauxmad worker --count`, a benchmark's simulated fleet) beat together, under
one key (`BeatGroup`, `bus.contract.beats`); a worker of its own, as in any real fleet, puts its own key as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.beats import WorkerBeats
from bus.contract.codec import encode
from bus.contract.fleet import WorkerInfo
from bus.transport.jetstream import MAX_CLOCK_SKEW, FleetKV
from bus.transport.nats_adapter import Nats

log = logging.getLogger(__name__)


SKEW_EVERY = 5  # beats between two measurements of the clock's skew (the first beat measures)
SOON = 0.05  # seconds a change that must beat soon waits for others to share its beat (a volume's)
USAGE_SHARE = 0.25  # of the interval: how long a machine's change of usage waits for its beat (see the top)
GROUP_MAX = 128  # members of a `BeatGroup` a key at most: a value of about 100 KB (the class's docstring)
PER_SLICE = 16  # members' infos a group's beat takes before it lets the event loop run (`GroupKey.beat`)


def skew_refusal(worker_id: str, skew: float) -> str:
    """The one line a worker with a skewed clock answers a reserve with."""
    way = "ahead of" if skew > 0 else "behind"
    return (
        f"worker {worker_id}'s clock is {abs(skew):.1f} s {way} its NATS server's, more than the {MAX_CLOCK_SKEW:g} s"
        " the fleet tolerates: it reserves nothing until the host's clock is set right (NTP)"
    )


class Coalesced:
    """A beat that goes within a time asked for, shared by every change until it goes (`Heartbeat.soon`); a
    change that must go sooner than the coming beat brings it forward, and the later one stands down."""

    def __init__(self) -> None:
        self._due: float | None = None  # when the coming beat goes (perf_counter), if one is coming

    def ask(
        self,
        within: float,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        send: Callable[[], Coroutine[Any, Any, None]],
    ) -> None:
        due = time.perf_counter() + within
        if self._due is not None and self._due <= due:
            return  # a beat at least as soon is coming, and will carry this change
        self._due = due

        async def beat() -> None:
            await asyncio.sleep(within)
            if self._due != due:
                return  # a sooner beat went instead, with this change
            self._due = None
            with contextlib.suppress(Exception):
                await send()

        spawn(beat())


class Heartbeat:
    def __init__(
        self,
        nc: Nats,
        kv: FleetKV,
        *,
        region: str,
        worker_id: str,
        interval: float,
        info: Callable[[], WorkerInfo],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        away_after: float | None = None,
        on_return: Callable[[], None] = lambda: None,
    ) -> None:
        self.nc = nc
        self.kv = kv
        self.region = region
        self.worker_id = worker_id
        self.interval = interval
        self.info = info
        self.spawn = spawn  # the agent's tasks: cancelled when it closes
        self.load = 0.0  # the host's load average per cpu, as of the last beat
        self._soon = Coalesced()  # the coming beat of `soon`, if one is coming
        self.away_after = away_after if away_after is not None else 2 * interval
        self.on_return = on_return  # an absence just ended
        self.absences = 0  # absences seen to end
        self._last_beat = time.perf_counter()  # when the registry last acknowledged a beat
        # how far this host's clock is ahead of the NATS server's (negative: behind), and the measurement's
        # uncertainty (half its round trip): from the time the server stored a beat (`_measure`)
        self.skew = 0.0
        self.skew_error = 0.0
        self._beats = 0
        # the key this worker beats under with the other logical workers of its process (`BeatGroup`), and its
        # place there; None: a worker of its own, under its own key
        self.group: GroupKey | None = None
        self.group_index = 0

    def away(self) -> bool:
        """Whether no beat was acknowledged for longer than `away_after` (a freeze or a cut is going on)."""
        return time.perf_counter() - self._last_beat > self.away_after

    def _beaten(self) -> None:
        now = time.perf_counter()
        if now - self._last_beat > self.away_after:
            self.absences += 1
            log.warning("worker %s: back after %.1f s without a heartbeat", self.worker_id, now - self._last_beat)
            self.on_return()
        self._last_beat = now

    async def put(self, info: WorkerInfo, *, acked: bool = True) -> None:
        """Put `info` into the registry; `acked=False` only publishes it (in order with the acked puts,
        on the same connection), and not at all while disconnected: no stale beat is buffered. A member of a
        group puts its group's key, with this info in it."""
        if self.group is not None:
            await self.group.put(self, info, acked=acked)
            return
        key = subjects.worker_key(self.region, self.worker_id)
        if acked:
            sent = time.time()
            revision = await self.kv.workers.put(key, encode(info))
            answered = time.time()
            self._beaten()
            if self._beats % SKEW_EVERY == 0:
                with contextlib.suppress(Exception):  # a measurement missed is taken at a later beat
                    await self._measure(revision, sent, answered)
            self._beats += 1
        elif self.nc.is_connected:
            bucket = self.kv.layout.workers_bucket(self.region)
            await self.nc.publish(subjects.kv_put(bucket, key), encode(info))

    async def _measure(self, revision: int, sent: float, answered: float) -> None:
        """This host's clock against the server's: the server stamps each stored message with its own time, so
        a beat's stamp read back, against the middle of the put's round trip, is the skew (+- half of it)."""
        stored = await self.nc.jetstream().get_msg(f"KV_{self.kv.layout.workers_bucket(self.region)}", revision)
        if stored.time is None:
            return
        skew = (sent + answered) / 2 - stored.time.timestamp()
        error = (answered - sent) / 2
        if abs(skew) - error > MAX_CLOCK_SKEW and abs(self.skew) - self.skew_error <= MAX_CLOCK_SKEW:
            log.warning("worker %s: %s", self.worker_id, skew_refusal(self.worker_id, skew))
        self.skew, self.skew_error = skew, error

    def skewed(self) -> str | None:
        """Why this worker must reserve nothing (its clock is surely off by more than the fleet allows), or None."""
        if abs(self.skew) - self.skew_error > MAX_CLOCK_SKEW:
            return skew_refusal(self.worker_id, self.skew)
        return None

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

    def soon(self, within: float = SOON) -> None:
        """Usage changed: tell the registry within `within` seconds rather than at the next tick (coalesced:
        every change until the beat goes shares it; a change that must go sooner than the coming beat brings
        it forward).

        Best effort, so published without waiting for JetStream's ack: at the fleet's rates this beat
        follows many reserves, and the ack's round trip cost about as much as the rest of the beat.
        The tick (every `heartbeat_interval`) still waits for its ack and says when puts fail.
        A member of a group beats with its group's key (`GroupKey.soon`).
        """
        if self.group is not None:
            self.group.soon(self, within)
            return
        self._soon.ask(within, self.spawn, lambda: self.once(acked=False))

    def usage_changed(self) -> None:
        """A machine was reserved, destroyed or resized: beat within a quarter of the interval (see the top)."""
        self.soon(self.interval * USAGE_SHARE)


class GroupKey:
    """One beat group's key (`subjects.group_key`, named after its first member) and what it holds: the last
    `WorkerInfo` of each of its members, encoded as its own key would hold it. Every put carries all of them
    (`bus.contract.beats.WorkerBeats`: a key's value is all a reader has), so a member whose info did not change
    is sent again as the very bytes it was, which a reader takes for no update (`bus.contract.beats.BeatGroups`)."""

    def __init__(self, first: Heartbeat) -> None:
        self.members: list[Heartbeat] = [first]
        self.beats: dict[str, bytes] = {}  # worker id -> its last WorkerInfo's bytes
        self._changed: set[int] = set()  # members (their index) whose usage changed since their last bytes
        self._soon = Coalesced()  # the coming beat of `soon`, if one is coming

    @property
    def key(self) -> str:
        first = self.members[0]
        return subjects.group_key(first.region, first.worker_id)

    def value(self) -> bytes:
        return encode(WorkerBeats(beats={worker_id: msgspec.Raw(beat) for worker_id, beat in self.beats.items()}))

    async def put(self, member: Heartbeat, info: WorkerInfo, *, acked: bool) -> None:
        """`member`'s new info, with the others' last, in one put (`Heartbeat.put` for a member of a group)."""
        self.beats[member.worker_id] = encode(info)
        await self._send(acked=acked)

    async def beat(self) -> None:
        """Every member's info now, in one acknowledged put (the timer's, once an interval). Built `PER_SLICE`
        members at a time, with the event loop let run between, so that a reserve of this process waits behind a
        few members' infos at most, not all of them."""
        try:
            load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
        except OSError:
            load = 0.0
        self._changed.clear()  # every member's info is taken again now
        for n, member in enumerate(self.members):
            if n and n % PER_SLICE == 0:
                await asyncio.sleep(0)
            member.load = load
            self.beats[member.worker_id] = encode(member.info())
        await self._send(acked=True)

    def soon(self, member: Heartbeat, within: float) -> None:
        """`Heartbeat.soon` for the whole key: a change of any member waits at most `within` for one put that
        carries every change until then (the members that changed, their info taken again; the others as they
        were). At most one put a `within` a key, whatever the number of members or of changes."""
        self._changed.add(member.group_index)
        self._soon.ask(within, member.spawn, self._changes)

    async def _changes(self) -> None:
        """The soon beat: the members that changed, their info taken again, the others as they were."""
        changed, self._changed = self._changed, set()
        if not changed:
            return  # a tick took every member's info since, and carried these changes
        for n in changed:
            one = self.members[n]
            self.beats[one.worker_id] = encode(one.info())
        await self._send(acked=False)

    async def _send(self, *, acked: bool) -> None:
        first = self.members[0]
        bucket = first.kv.layout.workers_bucket(first.region)
        if not acked:
            if first.nc.is_connected:
                await first.nc.publish(subjects.kv_put(bucket, self.key), self.value())
            return
        sent = time.time()
        revision = await first.kv.workers.put(self.key, self.value())
        answered = time.time()
        if first._beats % SKEW_EVERY == 0:  # one host, one clock: the first member measures it for all
            with contextlib.suppress(Exception):  # a measurement missed is taken at a later beat
                await first._measure(revision, sent, answered)
        first._beats += 1
        for member in self.members:
            if member.worker_id in self.beats:
                member._beaten()
                member.skew, member.skew_error = first.skew, first.skew_error


class BeatGroup:
    """The heartbeats of the logical workers one process runs (a benchmark's simulated fleet, `--count`): one put a
    process an interval, not one a logical worker (issue 44: at 1,000 workers beating every 2 s, 500 puts a second
    that nats-server stored and every broker's registry decoded, the simulator's background, set the p99). The
    members' infos go together under one key, `<region>.<first member>.group` (`bus.contract.beats`: what a
    reader sees is still one heartbeat per worker, and every member of a group whose key expires is gone with
    it). A real fleet has one worker per process and no group: its key and its value are what they always were.

    A group holds at most `GROUP_MAX` members a key (a process of more has a key per `GROUP_MAX`), so a value stays
    about 100 KB, far below any server's `max_payload`; the keys beat at ticks spread over the interval, one a
    tick. A member's change of usage (`Heartbeat.soon`) is its key's: every change within a quarter of the
    interval shares one put of the key.

    The host's clock is one for them all: each key's first member measures its skew against the server's (its
    key's stored beat read back, every `SKEW_EVERY` beats) and the key's other members take its figures."""

    def __init__(self, interval: float, size: int = 1) -> None:
        """`size`: the members to come (the process's logical workers), which sets the keys, a tick each."""
        self.interval = interval
        self.ticks = max(1, -(-size // GROUP_MAX))
        self.members: list[Heartbeat] = []
        self.keys: list[GroupKey] = []

    def add(self, heartbeat: Heartbeat) -> None:
        """Before its first beat, which is its key's put (`Heartbeat.put`)."""
        if not self.keys or len(self.keys[-1].members) >= GROUP_MAX:
            self.keys.append(GroupKey(heartbeat))
        else:
            self.keys[-1].members.append(heartbeat)
        heartbeat.group = self.keys[-1]
        heartbeat.group_index = len(self.keys[-1].members) - 1
        self.members.append(heartbeat)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        step = self.interval / self.ticks
        due = loop.time()
        tick = failed = 0
        while True:
            due += step  # on a schedule: the puts' round trips do not stretch the interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            keys = self.keys[tick % self.ticks :: self.ticks]
            tick += 1
            outcomes = await asyncio.gather(*(key.beat() for key in keys), return_exceptions=True)
            failed += sum(
                len(key.members) for key, out in zip(keys, outcomes, strict=True) if isinstance(out, Exception)
            )
            if tick % self.ticks == 0:  # one line an interval, not one a tick
                if failed:
                    log.warning("heartbeat failed for %d of %d workers of this process", failed, len(self.members))
                failed = 0
