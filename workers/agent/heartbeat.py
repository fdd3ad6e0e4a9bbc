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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.fleet import WorkerInfo
from bus.transport.jetstream import MAX_CLOCK_SKEW, FleetKV
from bus.transport.nats_adapter import Nats

log = logging.getLogger(__name__)


SKEW_EVERY = 5  # beats between two measurements of the clock's skew (the first beat measures)
SOON = 0.05  # seconds a change that must beat soon waits for others to share its beat (a volume's)
USAGE_SHARE = 0.25  # of the interval: how long a machine's change of usage waits for its beat (see the top)
PER_TICK = 16  # a `BeatGroup`'s members beaten at each of its ticks (why 16: the class's docstring)


def skew_refusal(worker_id: str, skew: float) -> str:
    """The one line a worker with a skewed clock answers a reserve with."""
    way = "ahead of" if skew > 0 else "behind"
    return (
        f"worker {worker_id}'s clock is {abs(skew):.1f} s {way} its NATS server's, more than the {MAX_CLOCK_SKEW:g} s"
        " the fleet tolerates: it reserves nothing until the host's clock is set right (NTP)"
    )


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
        self._due: float | None = None  # when the coming beat of `soon` goes (perf_counter), if one is coming
        self.away_after = away_after if away_after is not None else 2 * interval
        self.on_return = on_return  # an absence just ended
        self.absences = 0  # absences seen to end
        self._last_beat = time.perf_counter()  # when the registry last acknowledged a beat
        # how far this host's clock is ahead of the NATS server's (negative: behind), and the measurement's
        # uncertainty (half its round trip): from the time the server stored a beat (`_measure`)
        self.skew = 0.0
        self.skew_error = 0.0
        self._beats = 0
        # another worker of this process that measures the host's clock for both (`BeatGroup`): one host, one clock
        self.clock_of: Heartbeat | None = None

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
        on the same connection), and not at all while disconnected: no stale beat is buffered."""
        key = subjects.worker_key(self.region, self.worker_id)
        if acked:
            sent = time.time()
            revision = await self.kv.workers.put(key, encode(info))
            answered = time.time()
            self._beaten()
            if self.clock_of is not None:
                self.skew, self.skew_error = self.clock_of.skew, self.clock_of.skew_error
            elif self._beats % SKEW_EVERY == 0:
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
        """
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
                await self.once(acked=False)

        self.spawn(beat())

    def usage_changed(self) -> None:
        """A machine was reserved, destroyed or resized: beat within a quarter of the interval (see the top)."""
        self.soon(self.interval * USAGE_SHARE)


class BeatGroup:
    """The heartbeats of the logical workers one process runs (a benchmark's simulated fleet, `--count`): one
    timer beats them all, instead of a timer, a sleep and a wait per logical worker (issue 44: at 1,000 workers
    that background, not the placement, set the p99). Each put is still its own worker's key, acknowledged as
    before (`Heartbeat.once`), once an interval. A real fleet has one worker per process and no group.

    The timer ticks `ticks` times an interval and each tick beats `PER_TICK` members, each member at the same
    tick of every interval: beating all 125 of a process at once made a burst of puts every interval, in the
    process, in nats-server and in every broker's watch of the bucket, and a create that met it waited behind
    it (the 1,000-worker p99). Not one or a few a tick either: at 4 a tick (32 ticks an interval), an idle fleet of
    1,000 cost nats-server 0.080 cores and its broker 0.038, against 0.026 and 0.015 all at once (the puts of a
    tick travel and are read together; fewer, larger ticks amortize that), and the creates' p50 rose (1.08x). 16
    a tick: 8 ticks an interval for a process of 125.

    The host's clock is one for them all: the first member measures its skew against the server's (a stored
    beat read back, every `SKEW_EVERY` beats) and the others take its figures, rather than each asking
    JetStream for its own beat (at 1,000 workers, 100 requests a second to nats-server for one answer)."""

    def __init__(self, interval: float, size: int = 1) -> None:
        """`size`: the members to come (the process's logical workers), which sets the ticks an interval."""
        self.interval = interval
        self.ticks = max(1, -(-size // PER_TICK))
        self.members: list[Heartbeat] = []

    def add(self, heartbeat: Heartbeat) -> None:
        if self.members:
            heartbeat.clock_of = self.members[0]
        self.members.append(heartbeat)

    def due(self, tick: int) -> list[Heartbeat]:
        """The members that beat at `tick`: each member at one tick of every `ticks`, `PER_TICK` at most."""
        return self.members[tick % self.ticks :: self.ticks]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        step = self.interval / self.ticks
        due = loop.time()
        tick = failed = beaten = 0
        while True:
            due += step  # on a schedule: the puts' round trips do not stretch the interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            members = self.due(tick)
            tick += 1
            outcomes = await asyncio.gather(*(member.once() for member in members), return_exceptions=True)
            failed += sum(isinstance(outcome, Exception) for outcome in outcomes)
            beaten += len(outcomes)
            if tick % self.ticks == 0:  # one line an interval, not one a tick
                if failed:
                    log.warning("heartbeat failed for %d of %d workers of this process", failed, beaten)
                failed = beaten = 0
