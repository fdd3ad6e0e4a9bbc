"""The executor: applies a `Plan` over the bus, a bounded number of actions at a time, under leases.

Creates go through the brokers: one auction per machine, whose chain applies `avoid_workers` (a
spare off its primary's host) and `prefer_away` (rather not there). Every other action goes straight
to the machine's worker (or, for an identity that may not speak to workers, through the brokers: `routes`),
inside a lease, so two reconcilers (a deploy and a `reconcile --watch`) never
act on one machine at once: the second gets a 409 and leaves the machine to the next pass. An action
that fails is reported, never retried here: the next plan, made from fresh observations, decides again.
An action waiting on a worker whose heartbeat expires meanwhile (a host frozen mid-call) fails at once rather
than at its timeout (an update's is 40 s): a pass blocked on a silent host would fail over no other machine
(the fail-back test, in CI: the operator said nothing for 30 s while the frozen host's update waited).
A create has no worker to lose (it goes to the brokers), so an operator gives it `create_patience`: past that, the
create goes on by itself and the pass ends; the same create is not sent again while it waits (a later pass sees its
machine once it is made). Core NATS may drop a request while a nats-server restarts, and the create's own wait is
35 s: in CI (torture on hosts, seed 11) the operator's pass waited out a create lost that way while a worker came
back with the old primary still running beside the promoted spare, and the second primary outlived the settle.
Workers are spoken to over a `Bus` and the brokers through `MachinesApi` (see `ports`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import defaultdict
from collections.abc import Awaitable, Callable

import msgspec

from bus.contract.errors import FauxmadError, NoCapacity, Unanswered, Unreachable
from bus.contract.machines import (
    DestroyRequest,
    Lease,
    LeaseRequest,
    Machine,
    ReleaseRequest,
    StartRequest,
    StopRequest,
    UpdateRequest,
)
from orchestrator.apps.ownership import CREATED_BY_KEY, CREATED_FOR_KEY, MAX_REASON
from orchestrator.reconcile.actions import Action, Create, Destroy, MachineAction, Promote, Start, Stop, Update
from orchestrator.reconcile.ports import Bus, MachinesApi
from orchestrator.reconcile.routes import Route, to_workers

log = logging.getLogger(__name__)

# A machine's lease lasts LEASE_TTL and is renewed every third of it while its action runs: an action may take
# a stop timeout and more, yet a reconciler killed mid-action (kill -9: no `finally`) holds its machines from the
# next one for LEASE_TTL at the most. It was a flat 120 s (the next `fauxmad reconcile` waited out two minutes),
# then 15 s, which a destroy behind a killed deploy's lease outwaited under load. The renewals are the holder's
# heartbeat: three per TTL, each given a third of it to answer, so a working holder misses two in a row before
# its lease lapses, and a dead one's ends one TTL after its last renewal at most.
LEASE_TTL = 6.0


class Result(msgspec.Struct, kw_only=True):
    action: Action
    ok: bool
    machine_id: str = ""
    worker_id: str = ""
    error: str = ""  # the error's message, for whoever shows it
    error_type: type[FauxmadError] | None = None  # what went wrong, for whoever decides what to do next

    def failed_with(self, *kinds: type[FauxmadError]) -> bool:
        """The action failed with one of `kinds` (or a subclass of one)."""
        return self.error_type is not None and issubclass(self.error_type, kinds)

    @property
    def no_room(self) -> bool:
        return self.failed_with(NoCapacity)


def default_holder() -> str:
    return f"fauxmad-reconciler@{socket.gethostname()}:{os.getpid()}"


class Executor:
    def __init__(
        self,
        bus: Bus,
        machines: MachinesApi,
        *,
        concurrency: int = 8,
        holder: str | None = None,
        stop_timeout: float = 10.0,
        route: Route = to_workers,
        lost: Callable[[str], Awaitable[None]] | None = None,
        create_patience: float | None = None,
    ) -> None:
        self.bus = bus
        self.route = route
        self.machines = machines
        self.lost = lost  # returns once a worker is gone (its heartbeat expired); None: wait for every timeout
        self._abandoned: set[asyncio.Task[None]] = set()  # actions left to their silent workers
        # seconds a pass waits for a create's answer before it leaves the create to go on alone (None: its whole
        # wait, as a deploy does); the creates left so, by what they make, until they end
        self.create_patience = create_patience
        self._creating: dict[tuple[str, str, str, str], asyncio.Task[Machine]] = {}
        self.limit = asyncio.Semaphore(concurrency)
        self.holder = holder or default_holder()
        self.stop_timeout = stop_timeout

    async def apply(
        self, app: str, actions: tuple[Action, ...], on_result: Callable[[Result], None] | None = None
    ) -> list[Result]:
        async def one(action: Action) -> Result:
            if isinstance(action, Create) and self._create_key(app, action) in self._creating:
                # left to go on by an earlier pass: not sent again, and not said again at every pass while it waits
                error = f"an earlier create ({action.reason}) still waits for the brokers' answer"
                return Result(action=action, ok=False, error=error, error_type=Unanswered)
            async with self.limit:
                result = await self._run(app, action)
            if on_result is not None:
                on_result(result)
            return result

        # creates in one region go one after another, so each auction sees the machines placed before
        # it (the spread scorer counts them): placing them is the chain's job, ordering them is ours;
        # everything else runs side by side
        creates: dict[str, list[Create]] = defaultdict(list)
        for action in actions:
            if isinstance(action, Create):
                creates[action.region].append(action)

        async def in_turn(batch: list[Create]) -> list[Result]:
            return [await one(action) for action in batch]

        others = asyncio.gather(*[one(a) for a in actions if not isinstance(a, Create)])
        ordered = asyncio.gather(*[in_turn(batch) for batch in creates.values()])
        singles, batches = await asyncio.gather(others, ordered)
        return list(singles) + [r for batch in batches for r in batch]

    async def _run(self, app: str, action: Action) -> Result:
        try:
            if isinstance(action, Create):
                machine = await self._create_patiently(app, action)
                return Result(action=action, ok=True, machine_id=machine.id, worker_id=machine.worker_id)
            work = self._leased(app, action.worker_id, action.id, lambda nonce: self._verb(app, action, nonce))
            await self._unless_lost(action.worker_id, work, type(action).__name__.lower())
            return Result(action=action, ok=True, machine_id=action.id)
        except FauxmadError as exc:
            # the result carries the error to whoever shows it (the deploy's display, the operator's log
            # lines); a warning here would be a second, Python-formatted copy on stderr
            log.info("%s failed: %s", type(action).__name__.lower(), exc.message)
            machine_id = action.id if isinstance(action, MachineAction) else ""
            return Result(action=action, ok=False, machine_id=machine_id, error=exc.message, error_type=type(exc))

    async def _unless_lost(self, worker_id: str, work: Awaitable[None], verb: str) -> None:
        """`work` on `worker_id`, given up with `Unreachable` as soon as the worker is lost (`self.lost`). What it
        was waiting for is cancelled and left to end on its own (its lease's release may wait on the silent worker)."""
        doing = asyncio.ensure_future(work)
        if self.lost is None:
            return await doing
        losing = asyncio.ensure_future(self.lost(worker_id))
        try:
            await asyncio.wait({doing, losing}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            doing.cancel()
            raise
        finally:
            losing.cancel()
        if doing.done():
            return doing.result()
        doing.cancel()
        self._abandoned.add(doing)
        doing.add_done_callback(self._forget)
        raise Unreachable(f"worker {worker_id} was lost (its heartbeat expired) while the {verb} waited for it")

    def _forget(self, task: asyncio.Task[None]) -> None:
        """An abandoned action ended: its outcome is the next pass's to observe."""
        self._abandoned.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody waits for it

    async def _create_patiently(self, app: str, action: Create) -> Machine:
        """The create's machine, or with `create_patience`, `Unanswered` once that passes (the create goes on; its
        machine, if made, is the next pass's to see; the same create is not sent while it waits: `apply`)."""
        key = self._create_key(app, action)
        if self.create_patience is None:
            return await self._create(app, action)
        creating = asyncio.ensure_future(self._create(app, action))
        try:
            await asyncio.wait({creating}, timeout=self.create_patience)
        except BaseException:
            creating.cancel()
            raise
        if creating.done():
            return creating.result()
        self._creating[key] = creating
        creating.add_done_callback(lambda task: self._created(key, task))
        raise Unanswered(
            f"no answer from the brokers within {self.create_patience:g}s: the create goes on, the next pass sees"
            " its machine if it is made"
        )

    @staticmethod
    def _create_key(app: str, action: Create) -> tuple[str, str, str, str]:
        """What a create makes, as the next pass would plan it again: its app, region, role and why."""
        return (app, action.region, action.role, action.reason)

    def _created(self, key: tuple[str, str, str, str], task: asyncio.Task[Machine]) -> None:
        """A create left to go on ended: said in the log; its machine (if any) is the next pass's to observe."""
        self._creating.pop(key, None)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            log.info("the create (%s) left to go on made %s", key[3], task.result().id)
        else:
            log.info("the create (%s) left to go on failed: %s", key[3], exc)

    async def _create(self, app: str, action: Create) -> Machine:
        # one auction: `avoid_workers` is a filter of the chain, `prefer_away` a penalty (see placement/ask.py)
        origin = {CREATED_BY_KEY: action.made_by, CREATED_FOR_KEY: action.reason[:MAX_REASON]}
        config = msgspec.structs.replace(action.config, metadata={**action.config.metadata, **origin})
        return await self.machines.create(app, msgspec.structs.replace(action.request, config=config))

    async def _verb(self, app: str, action: MachineAction, nonce: str) -> None:
        worker, machine_id = (app, action.worker_id), action.id
        if isinstance(action, Start):
            await self._call(worker, "start", StartRequest(id=machine_id, lease_nonce=nonce))
        elif isinstance(action, Stop):
            await self._call(
                worker,
                "stop",
                StopRequest(id=machine_id, lease_nonce=nonce, timeout=self.stop_timeout),
                timeout=self.stop_timeout + 10,
            )
        elif isinstance(action, Destroy):
            await self._call(worker, "destroy", DestroyRequest(id=machine_id, lease_nonce=nonce, force=True))
        elif isinstance(action, Update):
            await self._call(
                worker,
                "update",
                UpdateRequest(id=machine_id, config=action.config, lease_nonce=nonce, timeout=self.stop_timeout),
                timeout=self.stop_timeout + 30,
            )
        elif isinstance(action, Promote):
            await self._call(worker, "update", UpdateRequest(id=machine_id, config=action.config, lease_nonce=nonce))
            if action.start:
                await self._call(worker, "start", StartRequest(id=machine_id, lease_nonce=nonce))

    async def _lease(
        self, app: str, worker_id: str, machine_id: str, nonce: str | None = None, timeout: float = 5.0
    ) -> Lease:
        """Take the machine's lease, or with `nonce` extend the one held (the worker keeps the nonce)."""
        return await self.bus.call(
            self.route(app, worker_id, "lease"),
            LeaseRequest(id=machine_id, ttl=LEASE_TTL, holder=self.holder, nonce=nonce),
            Lease,
            timeout=timeout,
        )

    async def _renew(self, app: str, worker_id: str, machine_id: str, nonce: str) -> None:
        """Keep the lease while the action runs. A renewal that fails is tried again at the next turn; if the
        lease lapses meanwhile and another reconciler takes it, this one's verbs get 409s (the next pass decides)."""
        while True:
            await asyncio.sleep(LEASE_TTL / 3)
            try:  # answered within the turn, or the next turn's renewal is due
                await self._lease(app, worker_id, machine_id, nonce, timeout=LEASE_TTL / 3)
            except FauxmadError as exc:
                log.info("lease of %s not renewed: %s", machine_id, exc.message)

    async def _call(self, where: tuple[str, str], verb: str, request: msgspec.Struct, timeout: float = 30.0) -> Machine:
        """`verb` of the machine at `where` (its app and worker)."""
        app, worker_id = where
        return await self.bus.call(self.route(app, worker_id, verb), request, Machine, timeout=timeout)

    async def _leased(self, app: str, worker_id: str, machine_id: str, work: Callable[[str], Awaitable[None]]) -> None:
        lease = await self._lease(app, worker_id, machine_id)
        renewing = asyncio.create_task(self._renew(app, worker_id, machine_id, lease.nonce))
        try:
            await work(lease.nonce)
        finally:
            renewing.cancel()
            with contextlib.suppress(Exception):  # a destroyed machine has no lease to release
                await self.bus.call(
                    self.route(app, worker_id, "release"),
                    ReleaseRequest(id=machine_id, nonce=lease.nonce),
                    Machine,
                    timeout=5,
                )
