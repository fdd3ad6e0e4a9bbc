"""Observed state for the reconcilers: asked of the workers themselves, never of a cache.

The worker is the source of truth, so a reconciler asks each live worker of the app's regions for
the app's machines (`fauxmad.v1.worker.<id>.machines.list`, in parallel): a machine reserved a
moment ago is never missed, so a re-planned create is never a duplicate. Liveness comes from a
replica of KV `fauxmad_workers`; machines on workers whose heartbeat expired come from a replica of
the routing index KV `fauxmad_machines`, which remembers each machine's worker, state and labels.
A worker whose heartbeat expires while a pass waits for its answer is dropped from the pass at once
(its machines come from the index), and no live worker is waited for longer than `ANSWER_WITHIN`.
The workers are asked over a `Bus` (see `ports`) and the replicas are passed in, so a unit test feeds
both from memory.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from bus.contract import subjects
from bus.contract.errors import FauxmadError, Unanswered, Unreachable
from bus.contract.machines import JOB_LABEL, ListRequest, Machine, MachineConfig
from bus.transport.jetstream import WORKER_TTL, FleetKV
from orchestrator.reconcile.actions import Member, Observed
from orchestrator.reconcile.ports import Bus
from orchestrator.reconcile.routes import Route, to_workers
from orchestrator.replicas.machines import MachineIndex
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)

INITIAL_VALUES_WITHIN = 25.0  # seconds the replicas may take to fill (see `Observer.start`)


def health(machine: Machine) -> tuple[bool, str]:
    """Started with every configured check passing; otherwise why not, in a few words."""
    if machine.state != "started":
        note = f"state {machine.state}"
        if machine.exit is not None and machine.exit.exit_code not in (None, 0):
            note += f", exit code {machine.exit.exit_code}"
        return False, note
    problems = []
    for name in sorted(machine.config.checks):
        status = machine.checks.get(name)
        if status is None or status.status != "passing":
            what = status.status if status else "not run yet"
            output = f": {status.output.strip()[:120]}" if status and status.output.strip() else ""
            problems.append(f"check {name} {what}{output}")
    return not problems, "; ".join(problems)


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def ulid_time(value: str) -> float:
    """The time (epoch seconds) in a ULID's first ten characters, as instance ids carry it; 0 if it is none."""
    if len(value) != 26:
        return 0.0
    ms = 0
    for char in value[:10].upper():
        digit = _CROCKFORD.find(char)
        if digit < 0:
            return 0.0
        ms = ms * 32 + digit
    return ms / 1000


def member(machine: Machine) -> Member:
    healthy, note = health(machine)
    return Member(
        id=machine.id,
        region=machine.region,
        worker_id=machine.worker_id,
        state=machine.state,
        config=machine.config,
        healthy=healthy,
        note=note,
        created_at=machine.created_at,
        exit=machine.exit,
        instance_at=ulid_time(machine.instance_id),
    )


# How long a pass waits for a live worker's list. A worker that does not answer within it fails the pass
# (the loop looks again within a poll), so a silent host never holds up failover for long; one whose
# heartbeat expires meanwhile is not waited for at all.
ANSWER_WITHIN = 1.0
# How long a one-shot command's pass (a deploy's first look) keeps asking a live worker that did not answer
# within ANSWER_WITHIN: a heartbeat TTL, after which a silent worker is gone and its machines come from the index.
# A worker back from a cut beats before it answers again (CI81: a deploy 1 s after a heal failed on its silence).
ONE_SHOT_PATIENCE = WORKER_TTL
AGAIN_AFTER = 0.1  # seconds between such askings (each has waited ANSWER_WITHIN already, unless the request broke)
LOST_LOOK = 0.5  # seconds between looks at a worker an action waits on (its heartbeat expiring has no event)
PROBE_WITHIN = 0.5  # a worker named by an edge proxy's signal has this long to answer before it is suspected


class Observer:
    def __init__(
        self,
        bus: Bus,
        *,
        registry: Registry | None = None,
        index: MachineIndex | None = None,
        on_change: Callable[[str], None] | None = None,
        answer_within: float = ANSWER_WITHIN,
        probe_within: float = PROBE_WITHIN,
        route: Route = to_workers,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: what a one-shot observation's patience is measured on (a test's own, to run it without waiting)."""
        self.bus = bus
        self.route = route
        self.clock = clock
        self.answer_within = answer_within
        self.probe_within = probe_within
        self.registry = registry or Registry()
        self.index = index or MachineIndex()
        self.registry.on_change = on_change
        self.index.on_change = on_change

    async def start(self, kv: FleetKV) -> None:
        """Fill the replicas from the KV and keep them current (a unit test `apply`s updates instead).

        Waits past the replicas' usual 5 s: a watch's initial values come as soon as every region answers, or
        after 4 s without the regions that do not, but while no region answers (JetStream electing its meta
        leader again, `bus.transport.regional`) up to 20 s; an empty registry taken for the fleet would tell a deploy
        that no region has a live worker."""
        await self.registry.start(kv.workers, timeout=INITIAL_VALUES_WITHIN)
        await self.index.start(kv.machines, timeout=INITIAL_VALUES_WITHIN)

    async def close(self) -> None:
        await self.registry.close()
        await self.index.close()

    def cordoned(self) -> frozenset[str]:
        return frozenset(w.worker_id for w in self.registry.workers() if w.cordoned)

    async def machines_on(self, worker_id: str, app: str | None, timeout: float = 5.0) -> builtins.list[Machine]:
        """The app's machines on `worker_id` (every app's: `None`, asked of the worker itself); through the brokers
        (`routes`), a list of the app that names the worker."""
        if app is None or self.route is to_workers:
            subject, request = subjects.worker_machines(worker_id, "list"), ListRequest(app=app)
        else:
            subject, request = self.route(app, worker_id, "list"), ListRequest(app=app, worker_id=worker_id)
        return await self.bus.call(
            subject,
            request,
            builtins.list[Machine],
            timeout=timeout,
        )

    async def check_host(self, worker_id: str, app: str) -> bool:
        """An edge proxy says a machine on `worker_id` refused it: ask the worker itself. Silence (nobody
        subscribed, or no answer within `PROBE_WITHIN`) makes it suspected (gone until it heartbeats
        again), so the app's spares start now rather than when the heartbeat expires. True if suspected.

        A worker that answers is trusted: a machine that refused a connection on a live worker is that
        worker's to restart (its supervisor), not ours to replace."""
        if not self.registry.is_live(worker_id):
            return False  # already gone for us: nothing to add
        try:
            await self.machines_on(worker_id, app, timeout=self.probe_within)
        except Unreachable as exc:  # no responders at once, or `Unanswered` after the probe's timeout
            log.warning("worker %s did not answer a probe after an edge proxy's signal: %s", worker_id, exc.message)
            self.registry.suspect(worker_id)
            return True
        except FauxmadError:
            return False  # it answered, with an error: it is alive
        return False

    async def lost(self, worker_id: str) -> None:
        """Return once `worker_id` is gone for us: its heartbeat expired (looked at every `LOST_LOOK` seconds, and
        at every departure) or it is suspected."""
        while self.registry.is_live(worker_id):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.registry.departure(), LOST_LOOK)

    async def _machines_unless_lost(self, worker_id: str, app: str) -> builtins.list[Machine] | None:
        """A live worker's machines; `None` as soon as its heartbeat expires while we wait for them."""
        asking = asyncio.ensure_future(self.machines_on(worker_id, app, timeout=self.answer_within))
        try:
            while True:
                departure = asyncio.ensure_future(self.registry.departure())
                await asyncio.wait({asking, departure}, return_when=asyncio.FIRST_COMPLETED)
                departure.cancel()
                if asking.done():
                    return asking.result()
                if not self.registry.is_live(worker_id):
                    return None  # lost while we asked: its machines come from the index, now
        finally:
            asking.cancel()

    async def observe(
        self,
        app: str,
        regions: Iterable[str],
        *,
        unhealthy_since: Mapping[str, float] | None = None,
        no_room_for_spares: frozenset[str] = frozenset(),
        exits_since: float | None = None,
        only_region: str | None = None,
        patience: float = 0.0,
    ) -> Observed:
        """`only_region`: an operator of one region observes that region's machines and workers only. `patience`:
        seconds a live worker that does not answer is asked again (a loop's pass: none, it looks again anyway; a
        one-shot command's: `ONE_SHOT_PATIENCE`); one whose heartbeat expires meanwhile is not waited for."""
        entries = [e for e in self.index.by_app(app) if only_region is None or e.region == only_region]
        wanted = set(regions) | {e.region for e in entries}
        alive = self.registry.workers()
        live = {w.worker_id for w in alive}
        workers = [
            w.worker_id for w in alive if w.region in wanted and (only_region is None or w.region == only_region)
        ]

        until = self.clock() + patience

        async def ask(worker_id: str) -> builtins.list[Machine] | None:
            while True:
                try:
                    return await self._machines_unless_lost(worker_id, app)
                except FauxmadError as exc:
                    if isinstance(exc, Unanswered):
                        if not self.registry.is_live(worker_id):
                            return None  # gone while we asked: its machines come from the index
                        if self.clock() < until:
                            await asyncio.sleep(AGAIN_AFTER)
                            continue
                    log.info("observe: worker %s did not answer: %s", worker_id, exc.message)
                    raise

        answers = await asyncio.gather(*[ask(w) for w in workers])
        machines = [
            member(m)
            for group in answers
            if group is not None
            for m in group
            if m.state != "destroyed" and JOB_LABEL not in m.config.metadata  # a job's machine is not the app's
        ]
        seen = {m.id for m in machines}
        live = {w for w, group in zip(workers, answers, strict=True) if group is not None} | (live - set(workers))
        lost = tuple(
            Member(
                id=e.id,
                region=e.region,
                worker_id=e.worker_id,
                state=e.state,
                config=MachineConfig(metadata=dict(e.metadata)),
            )
            for e in entries
            if e.worker_id not in live
            and e.id not in seen
            and e.state not in ("destroyed", "destroying")
            and JOB_LABEL not in e.metadata
        )
        return Observed(
            machines=tuple(machines),
            lost=lost,
            cordoned=self.cordoned(),
            unhealthy_since=dict(unhealthy_since or {}),
            no_room_for_spares=no_room_for_spares,
            exits_since=exits_since,
        )
