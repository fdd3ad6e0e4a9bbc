"""The clients: each creates, starts, stops and destroys its own machines and takes leases, over the brokers.

Why it exists: the faults only matter against traffic, and the checker needs every request a client made
with its invoke time, completion time and outcome. Each client is an asyncio task with its own app (so the
operator, which manages apps with releases, leaves its machines alone), its own NATS connection (one that
reconnects forever, as an agent's does: a client outlives a nats-server restart) and its own seeded plan
(`lab.torture.plan.client_steps`). It talks to the fleet as any program would: `orchestrator.client`'s
`FleetClient` for the machine verbs, and the contract's `lease`/`release` (which the typed client does not
wrap) with `bus.transport.service.call`. Requests are sequential within a client.

Outcomes: `ok`; `refused` when the fleet said no (4xx, 503 no capacity, 502 nobody serving the subject: the
request was not carried out); `unknown` when no answer came in time, or a 504/500, or a 502 that says no answer
came from behind the broker (it may have happened: a worker behind a cut link got the request and acted).
A create is retried with the same idempotency key after an unknown outcome or a 5xx, a few times at once
and again by a later create step of the same slot, so a key may be retried many times; every machine
carries its key in `config.metadata.torture_key`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from bus.contract import subjects
from bus.contract.errors import FauxmadError, Unanswered
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Lease, LeaseRequest, Machine, MachineConfig, ReleaseRequest
from bus.transport.connection import connect
from bus.transport.service import call
from lab.torture.fleet import MACHINE_CMD, MACHINE_CPUS, MACHINE_MEMORY_MB
from lab.torture.history import HistoryWriter, Op
from lab.torture.plan import ClientStep, client_steps
from lab.torture.procs import MARKER_ENV
from orchestrator.client import FleetClient

T = TypeVar("T")

SLOTS = 2  # machines a client may hold at once: 5 clients x 2 + the operator's 4 on 16 cpus, so room is tight
CREATE_ATTEMPTS = 5  # attempts of a key within one create step
NO_CAPACITY_ATTEMPTS = 2  # of which at most this many when every answer was 503 no capacity
OP_TIMEOUT = 10.0  # seconds a client waits for any answer
LEASE_TIMEOUT = 4.0
REFUSED_CODES = frozenset({400, 403, 404, 409, 412, 502, 503})
RETRY_CODES = frozenset({500, 502, 503, 504})
NOT_DELIVERED = "nobody answers on"  # `NoResponders`' message: nobody listens, so the request went nowhere


class Slot:
    """One machine a client holds, or the key it is still trying to create one with."""

    def __init__(self) -> None:
        self.machine_id: str | None = None
        self.key: str | None = None  # the key of the machine held, or of the create not yet acknowledged
        self.region: str | None = None
        self.generation = 0
        self.attempts = 0  # creates sent with `key` so far
        self.unknown = False  # one of them had an unknown outcome: `key` must be retried, never dropped


def outcome_of(exc: BaseException) -> tuple[str, int | None, str]:
    """(outcome, code, error) of a failed request."""
    if isinstance(exc, Unanswered):
        return "unknown", None, exc.message
    if isinstance(exc, FauxmadError):
        if exc.code == 502 and not exc.message.startswith(NOT_DELIVERED):
            # a 502 relayed from behind a broker is either "nobody listens" (not delivered) or "no answer" (it may
            # have arrived: `Unanswered` has 502 too); only the message tells them apart on the wire
            return "unknown", exc.code, exc.message
        return ("refused" if exc.code in REFUSED_CODES else "unknown"), exc.code, exc.message
    if isinstance(exc, TimeoutError):
        return "unknown", None, "no answer within the client's timeout"
    return "unknown", None, f"{type(exc).__name__}: {exc}"


class Client:
    def __init__(self, index: int, seed: int, regions: list[str], url: str, marker: str, history: HistoryWriter):
        self.name = f"c{index}"
        self.app = f"torture-{self.name}"
        self.seed = seed
        self.regions = regions
        self.url = url
        self.marker = marker
        self.history = history
        self.slots = [Slot() for _ in range(SLOTS)]
        self.fleet: FleetClient | None = None

    async def run(self, stop: asyncio.Event) -> None:
        self.fleet = FleetClient(await connect(self.url, f"torture-{self.name}", agent=True), timeout=OP_TIMEOUT)
        try:
            for step in client_steps(self.seed, self.name, self.regions, SLOTS):
                if stop.is_set():
                    return
                await self.step(step, stop)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), step.pause)
        finally:
            await self.fleet.close()

    # -- one request --------------------------------------------------------------------------------
    async def _request(self, op: Op, request: Awaitable[T], timeout: float = OP_TIMEOUT) -> T | None:
        """Send, record invoke/completion/outcome (and a machine's id and state, a lease's nonce and expiry) in
        `op`, write it; the answer, or None."""
        op.invoke = time.time()
        try:
            result = await asyncio.wait_for(request, timeout)
        except Exception as exc:
            op.complete = time.time()
            op.outcome, op.code, op.error = outcome_of(exc)  # type: ignore[assignment]
            op.error = op.error[:300]
            self.history.write(op)
            return None
        op.complete = time.time()
        op.outcome = "ok"
        if isinstance(result, Machine):
            op.machine_id = op.machine_id or result.id
            op.state = result.state
        elif isinstance(result, Lease):
            op.nonce, op.expires_at = result.nonce, result.expires_at
        self.history.write(op)
        return result

    def _op(self, step: ClientStep, kind: str, **fields: Any) -> Op:
        return Op(client=self.name, step=step.index, kind=kind, app=self.app, invoke=time.time(), **fields)

    def _skip(self, step: ClientStep, why: str) -> None:
        """A planned step that had nothing to act on, recorded under the step's kind (so a replay compares)."""
        op = self._op(step, step.kind, outcome="skipped", error=why)
        op.complete = op.invoke
        self.history.write(op)

    def _config(self, key: str) -> MachineConfig:
        return MachineConfig(
            cmd=MACHINE_CMD,
            guest=Guest(cpus=MACHINE_CPUS, memory_mb=MACHINE_MEMORY_MB),
            env={MARKER_ENV: self.marker},
            metadata={"torture_key": key, "torture_client": self.name},
        )

    # -- steps --------------------------------------------------------------------------------------
    async def step(self, step: ClientStep, stop: asyncio.Event) -> None:
        slot = self.slots[step.slot]
        if step.kind == "create":
            await self._create(step, slot, stop)
        elif step.kind == "replay":
            await self._replay(step, slot)
        elif step.kind in ("start", "stop", "destroy"):
            await self._act(step, slot)
        elif step.kind == "lease":
            await self._lease(step, slot, [step.holder])
        elif step.kind == "lease_race":
            await self._lease(step, slot, ["a", "b"])

    async def _create(self, step: ClientStep, slot: Slot, stop: asyncio.Event) -> None:
        if slot.machine_id is not None:
            self._skip(step, "slot holds a machine")
            return
        if slot.key is None:  # a new key; else the key whose create is still unacknowledged, again
            slot.key = f"{self.name}-s{step.slot}-g{slot.generation}"
            slot.region = step.region
            slot.generation += 1
            slot.attempts = 0
            slot.unknown = False
        key, region = slot.key, slot.region or step.region
        assert self.fleet is not None
        for tries in range(1, CREATE_ATTEMPTS + 1):
            slot.attempts += 1
            op = self._op(step, "create", key=key, attempt=slot.attempts, region=region)
            request = CreateRequest(region=region, config=self._config(key), idempotency_key=key)
            machine = await self._request(op, self.fleet.create(self.app, request))
            if machine is not None:
                slot.machine_id = machine.id
                return
            if op.outcome == "unknown":
                slot.unknown = True  # it may exist: this key is retried until an answer says what happened
            elif op.code not in RETRY_CODES or (op.code == 503 and tries >= NO_CAPACITY_ATTEMPTS and not slot.unknown):
                break
            if stop.is_set():
                return
            await asyncio.sleep(0.2 * tries)
        if not slot.unknown:  # every attempt refused: nothing exists under this key; a new key (and region) next time
            slot.key = None

    async def _replay(self, step: ClientStep, slot: Slot) -> None:
        """Re-send the create of the machine held, with its key: the same machine must come back."""
        if slot.machine_id is None or slot.key is None or slot.region is None:
            self._skip(step, "slot holds no machine")
            return
        assert self.fleet is not None
        op = self._op(step, "create", key=slot.key, replay=True, region=slot.region)
        request = CreateRequest(region=slot.region, config=self._config(slot.key), idempotency_key=slot.key)
        await self._request(op, self.fleet.create(self.app, request))

    async def _act(self, step: ClientStep, slot: Slot) -> None:
        if slot.machine_id is None:
            self._skip(step, "slot holds no machine")
            return
        assert self.fleet is not None
        machine_id = slot.machine_id
        op = self._op(step, step.kind, machine_id=machine_id)
        if step.kind == "start":
            await self._request(op, self.fleet.start(self.app, machine_id))
        elif step.kind == "stop":
            await self._request(op, self.fleet.stop(self.app, machine_id, timeout=3.0))
        else:
            await self._request(op, self.fleet.destroy(self.app, machine_id, force=True))
            if op.outcome != "refused":  # destroyed, or maybe: either way no longer this slot's
                slot.machine_id = slot.key = slot.region = None

    async def _lease(self, step: ClientStep, slot: Slot, holders: list[str]) -> None:
        if slot.machine_id is None:
            self._skip(step, "slot holds no machine")
            return
        machine_id = slot.machine_id
        ops = [self._op(step, "lease", machine_id=machine_id, holder=f"{self.name}-{h}") for h in holders]
        leases = await asyncio.gather(*(self._take(op, machine_id, step.ttl) for op in ops))
        if not step.release:
            return
        await asyncio.sleep(min(step.ttl / 2, 0.3))
        for lease in leases:
            if lease is not None:
                op = self._op(step, "release", machine_id=machine_id, holder=lease.holder, nonce=lease.nonce)
                subject = subjects.api_machines(self.app, "release")
                assert self.fleet is not None
                request = ReleaseRequest(id=machine_id, nonce=lease.nonce)
                await self._request(op, call(self.fleet.nc, subject, request, Machine, timeout=LEASE_TIMEOUT), 6.0)

    async def _take(self, op: Op, machine_id: str, ttl: float) -> Lease | None:
        assert self.fleet is not None and op.holder is not None
        request = LeaseRequest(id=machine_id, ttl=ttl, holder=op.holder)
        subject = subjects.api_machines(self.app, "lease")
        return await self._request(op, call(self.fleet.nc, subject, request, Lease, timeout=LEASE_TIMEOUT), 6.0)
