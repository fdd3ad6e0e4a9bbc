"""The machine manager: every lifecycle verb, each one a checked transition committed before it is told.

It knows nothing of NATS. Verbs come in as request Structs and leave as `Machine`s or
`FauxmadError`s; every state change goes through the `Recorder` (one lock per machine, a checked
transition, one `put_machine` in a group-committed LMDB transaction, then `on_commit`: the agent
publishes events and index updates from there). So verbs, process exits and restarts of one
machine never interleave, and different machines never wait for each other.

This module holds the verbs' orchestration (locks, commits, the driver's calls, in order) and nothing
else. Their parts live beside it, each with one job: `leases` (checked in every changing commit),
`reservation` (whether this worker takes a machine, and its first record), `launch_spec` (what a
process runs with), `pause` (suspend and resume), `update` (a new config, a replacement). What happens
once a process runs (its exit, restarts, health checks) is the `Supervisor`'s, and finishing what was in
flight when the worker died is `resume`'s. Both call back here only for what a verb owns: the task
spec a process runs with, a launch, a destroy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal as signals
import time
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from bus.contract.base import State
from bus.contract.errors import BadRequest, Conflict, DeadlineExceeded, NotFound
from bus.contract.ids import new_machine_id
from bus.contract.machines import (
    DestroyRequest,
    ExecReply,
    ExecRequest,
    ExitInfo,
    GetRequest,
    Lease,
    LeaseRequest,
    ListRequest,
    Machine,
    ReleaseRequest,
    ReserveRequest,
    ResumeRequest,
    SignalRequest,
    StartRequest,
    StopRequest,
    SuspendRequest,
    UpdateRequest,
    WaitRequest,
)
from bus.local.ports import PortRange
from workers.driver.base import Driver, TaskHandle, TaskSpec
from workers.image_cache import ImageCache
from workers.lifecycle import leases, steps, update
from workers.lifecycle.config import ManagerConfig
from workers.lifecycle.exits import exit_info, read_stderr_tail
from workers.lifecycle.fence import Fence
from workers.lifecycle.launch_spec import LaunchSpecs
from workers.lifecycle.pause import Pauses
from workers.lifecycle.recorder import CommitHook, Recorder
from workers.lifecycle.reservation import Reservations
from workers.lifecycle.resume import resume_in_flight
from workers.lifecycle.signals import parse_signal
from workers.lifecycle.supervisor import Supervisor
from workers.log.commit import GroupCommitter
from workers.log.machine_states import PROCESS_STATES, STARTABLE
from workers.log.records import StoredMachine
from workers.log.stamps import pick_port
from workers.log.store import Store, Tx
from workers.volumes.verbs import VolumeManager, detach

__all__ = ["CanExec", "MachineManager", "ManagerConfig"]

log = logging.getLogger(__name__)

DESTROY_WAIT = 15.0  # seconds a destroy waits for its process to end after the kill (the driver kills harder at 5)
# Seconds a start of a machine still stopping waits for the stop to end before it is refused as `stopping`: a stop's
# signal, its timeout (10 s by default) and the kill after it.
STOPPING_PATIENCE = 15.0


@runtime_checkable
class CanExec(Protocol):
    """A driver that can run a command beside a machine's workload (the process driver can)."""

    async def exec(self, handle: TaskHandle, spec: TaskSpec, cmd: list[str], timeout: float) -> ExecReply: ...


FENCED = "fenced: its idempotency key was placed elsewhere while this worker was away"


class MachineManager:
    def __init__(
        self,
        config: ManagerConfig,
        store: Store,
        committer: GroupCommitter,
        driver: Driver,
        *,
        on_commit: CommitHook = lambda records: None,
        on_launch: Callable[[Machine], None] = lambda machine: None,
        secret_env: Callable[[str], dict[str, str]] = lambda app: {},
        held_ports: Callable[[], Container[int]] = lambda: (),
        port_range: PortRange | None = None,
        images: ImageCache | None = None,
        volumes: VolumeManager | None = None,
        fence: Fence | None = None,
        clock: Callable[[], float] = time.time,
        skewed: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.config = config
        self.fence = fence  # keyed machines reserved before an absence run only if still the key's
        self.store = store
        self.driver = driver
        self.on_launch = on_launch  # right before a process is spawned (the agent follows its logs from there)
        self.held_ports = held_ports  # ports of this worker's machines not destroyed: a create passes them over
        self.port_range = port_range  # where its machines' ports are picked (None: the machines' half of the host's)
        self.images = images  # the image cache (the jobs runner's too, for an image job's files)
        self.clock = clock
        self.inflight = 0
        self.recorder = Recorder(committer, on_commit=on_commit, clock=clock)
        self.supervisor = Supervisor(
            self, self.recorder, store, driver, backoff=config.backoff, check_host=config.check_host
        )
        # the parts, each with one job (this module's docstring)
        self.specs = LaunchSpecs(config, images=images, volumes=volumes, secret_env=secret_env)
        self.reservations = Reservations(config, self.recorder, skewed)
        self.pauses = Pauses(self)

    # ------------------------------------------------------------------------------------------
    # reads

    def _state(self, machine: Machine) -> State:
        """The state reads show: a resumed machine is `started` from its answer on; its record follows
        within milliseconds."""
        if self.pauses.resuming(machine.id) and machine.state in ("suspended", "suspending"):
            return "started"
        return machine.state

    def view(self, stored: StoredMachine, *, events: bool = False) -> Machine:
        machine = msgspec.structs.replace(
            stored.machine, state=self._state(stored.machine), address=self.config.address or stored.machine.address
        )
        if events:
            machine.events = list(reversed(stored.events))
        return machine

    def require(self, machine_id: str) -> StoredMachine:
        stored = self.store.get(machine_id)
        if stored is None:
            raise NotFound(f"machine {machine_id} not found on worker {self.config.worker_id}")
        return stored

    def lock(self, machine_id: str) -> asyncio.Lock:
        """The lock of a machine that exists: a made-up id is a 404 here and leaves no lock behind."""
        self.require(machine_id)
        return self.recorder.lock(machine_id)

    def get(self, request: GetRequest) -> Machine:
        return self.view(self.require(request.id), events=request.events)

    def list(self, request: ListRequest) -> list[Machine]:
        out = []
        for stored in self.store.machines():
            machine = stored.machine
            if request.app and machine.app != request.app:
                continue
            if request.state and self._state(machine) != request.state:
                continue
            if machine.state == "destroyed" and not request.include_destroyed and request.state != "destroyed":
                continue
            out.append(self.view(stored))
        out.sort(key=lambda m: (m.app, m.created_at, m.id))
        return out

    async def wait(self, request: WaitRequest) -> Machine:
        stored = self.require(request.id)
        if stored.machine.state == request.state:
            return self.view(stored)
        if stored.machine.state == "destroyed":
            raise Conflict(f"machine {request.id} is destroyed; it will never be {request.state}")
        return await self.wait_for(request.id, {request.state}, request.timeout)

    async def wait_for(self, machine_id: str, states: Iterable[str], timeout: float) -> Machine:
        wanted = frozenset(states)
        future = self.recorder.waiters.add(machine_id, wanted)
        # re-check after registering, so a commit between the read and the registration is not missed
        stored = self.store.get(machine_id)
        if stored is not None and stored.machine.state in wanted and not future.done():
            future.set_result(self.view(stored))
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            current = self.store.get(machine_id)
            state = current.machine.state if current else "gone"
            raise DeadlineExceeded(
                f"machine {machine_id} did not become {'/'.join(sorted(wanted))} within {timeout:g}s (it is {state})"
            ) from None

    # ------------------------------------------------------------------------------------------
    # leases

    async def lease(self, request: LeaseRequest) -> Lease:
        result: Lease = await self.recorder.commit(leases.take(request))
        return result

    async def release(self, request: ReleaseRequest) -> Machine:
        return self.view(await self.recorder.commit(leases.release(request)))

    # ------------------------------------------------------------------------------------------
    # reserve

    async def reserve(self, request: ReserveRequest) -> Machine:
        """Record the machine (`created`), or with `launch` record it `starting` in the same commit and start
        it before answering: one request and two commits for a create+start instead of two and three."""
        self.reservations.check(request)
        machine_id = request.id or new_machine_id()
        port = pick_port(self.held_ports(), self.port_range)
        mark = self.fence.mark() if self.fence is not None else 0
        stored, reserved = await self.recorder.commit(self.reservations.op(request, machine_id, port))
        steps.reached("reserve.committed")
        if reserved and request.launch:
            stored = await self._launch_reserved(machine_id, mark)
        return self.view(stored)

    async def _launch_reserved(self, machine_id: str, mark: int) -> StoredMachine:
        """Start a machine just reserved `starting` (a stop or destroy may have come first: then leave it).

        If this worker was away since the reserve arrived (`mark`), a keyed machine first asks its claim: the
        broker may have fenced this worker and placed the key's machine elsewhere meanwhile (the fence)."""
        async with self.lock(machine_id):
            current = self.require(machine_id)
            if current.machine.state != "starting" or current.handle is not None:
                return current
            if self.fence is not None and self.fence.must_check(current, mark):
                found = await self.fence.verdict(current)
                if found == "elsewhere":
                    return await self._fence_off(current)
                if found == "unknown":
                    return await self._not_started(current, "its idempotency key's claim could not be read")
            return await self.launch(current)

    async def _not_started(self, stored: StoredMachine, why: str) -> StoredMachine:
        reason = f"not started: this worker was away and {why}"

        def failed(tx: Tx) -> StoredMachine:
            current = tx.require(stored.machine.id)
            self.recorder.event(current, "failed", reason=reason)
            return tx.put_machine(current, "start_failed")

        result: StoredMachine = await self.recorder.commit(failed)
        return result

    async def _fence_off(self, stored: StoredMachine) -> StoredMachine:
        """Destroy a keyed machine the fleet placed elsewhere while this worker was away (caller holds the
        lock). Leases do not hold it: it was never the key's machine to anyone who holds one."""
        machine_id = stored.machine.id

        def op(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            current.desired = "destroyed"
            self.recorder.event(current, "destroying", reason=FENCED)
            return tx.put_machine(current, "destroy")

        current = await self.recorder.commit(op)
        self.supervisor.cancel_restart(machine_id)
        current = await self.finish_destroy(current)
        self.recorder.forget(machine_id)
        return current

    async def sweep_fenced(self) -> dict[str, int]:
        """At start and after every absence: ask the claim of each keyed machine not confirmed yet, and destroy
        the ones whose key's machine is elsewhere. Returns counts per verdict."""
        counts: dict[str, int] = {}
        if self.fence is None:
            return counts
        for stored in self.fence.unconfirmed(list(self.store.machines())):
            found = await self.fence.verdict(stored)
            counts[found] = counts.get(found, 0) + 1
            if found == "elsewhere":
                async with self.lock(stored.machine.id):
                    current = self.require(stored.machine.id)
                    if current.machine.state not in ("destroyed", "destroying"):
                        await self._fence_off(current)
        return counts

    # ------------------------------------------------------------------------------------------
    # start

    async def start(self, request: StartRequest) -> Machine:
        patience_until = time.monotonic() + STOPPING_PATIENCE
        while True:
            await self._stopped_first(request, patience_until)
            async with self.lock(request.id):
                if self._must_wait_for_stop(request, patience_until):
                    continue  # a stop committed its `stopping` while this start queued for the lock: wait, unlocked

                def op(tx: Tx) -> tuple[StoredMachine, bool]:
                    stored = tx.require(request.id)
                    leases.check(stored, request.lease_nonce, tx.now)
                    if stored.machine.state in ("started", "starting"):
                        return stored, False
                    if stored.machine.state not in STARTABLE:
                        raise Conflict(f"machine {request.id} is {stored.machine.state}; it cannot be started")
                    self.recorder.event(stored, "starting", source="user", reason="start requested")
                    stored.desired = "started"
                    stored.restart_attempts = 0
                    return tx.put_machine(stored, "start"), True

                stored, changed = await self.recorder.commit(op)
                if changed:
                    stored = await self.launch(stored)
                return self.view(stored)

    async def _stopped_first(self, request: StartRequest, patience_until: float) -> None:
        """A start of a machine still stopping waits for the stop to end (until `patience_until`, monotonic), then
        starts it as it starts a stopped one: a request at the edge that met its machine's autostop halfway wakes
        it. A stop releases the machine's lock once its `stopping` is recorded, so the start waits unlocked."""
        if not self._must_wait_for_stop(request, patience_until):
            return
        with contextlib.suppress(DeadlineExceeded):  # still stopping: refused under the lock, saying so
            await self.wait_for(
                request.id, {"stopped", "failed", "destroyed"}, max(0.0, patience_until - time.monotonic())
            )

    def _must_wait_for_stop(self, request: StartRequest, patience_until: float) -> bool:
        """Whether the machine is `stopping` and this start may still wait for that to end. Not for a start its
        lease refuses (refused at once), nor for a machine that destroys itself once stopped (`auto_destroy`: it
        would be started only to be destroyed by its stop's destroy), nor once the patience is spent."""
        stored = self.store.get(request.id)
        if stored is None or stored.machine.state != "stopping" or stored.machine.config.auto_destroy:
            return False
        leases.check(stored, request.lease_nonce, self.clock())
        return time.monotonic() < patience_until

    def task_spec(self, stored: StoredMachine) -> TaskSpec:
        """What the driver runs for this machine (the supervisor's checks run in it too)."""
        return self.specs.task_spec(stored)

    def workdir(self, machine_id: str) -> Path:
        return self.specs.workdir(machine_id)

    async def launch(self, stored: StoredMachine) -> StoredMachine:
        """Spawn the process of a `starting` machine and record `started` (caller holds the lock)."""
        machine_id = stored.machine.id
        self.on_launch(stored.machine)
        self.inflight += 1
        try:
            pulled = await self.specs.prepare(stored.machine)  # its image and volumes, before it runs
            handle = await self.driver.start(self.specs.task_spec(stored))
            steps.reached("launch.spawned")
        except Exception as exc:
            log.warning("machine %s: could not start: %r", machine_id, exc)
            reason = f"could not start: {exc}"

            def failed(tx: Tx) -> StoredMachine:
                current = tx.require(machine_id)
                self.recorder.event(current, "failed", reason=reason)
                return tx.put_machine(current, "start_failed")

            result: StoredMachine = await self.recorder.commit(failed)
            return result
        finally:
            self.inflight -= 1

        def started(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            current.handle = handle
            note = f" ({pulled.describe()})" if pulled is not None else ""
            self.recorder.event(current, "started", reason=f"process {handle.pid} running{note}")
            if current.machine.config.image:
                tx.touch_image(current.machine.config.image)
            return tx.put_machine(current, "started")

        stored = await self.recorder.commit(started)
        self.supervisor.supervise(stored)
        return stored

    # ------------------------------------------------------------------------------------------
    # stop, signal, destroy

    async def stop(self, request: StopRequest) -> Machine:
        signum = parse_signal(request.signal)
        frozen = [False]  # was it suspended?
        async with self.lock(request.id):

            def op(tx: Tx) -> tuple[StoredMachine, bool]:
                stored = tx.require(request.id)
                leases.check(stored, request.lease_nonce, tx.now)
                state = stored.machine.state
                if state in ("stopped", "created", "failed", "stopping"):
                    return stored, state == "stopping"
                if state in ("destroying", "destroyed"):
                    raise Conflict(f"machine {request.id} is {state}; it cannot be stopped")
                frozen[0] = state in ("suspending", "suspended")
                stored.desired = "stopped"
                stored.stop_signal = request.signal
                self.recorder.event(stored, "stopping", source="user", reason=f"stop requested ({request.signal})")
                if state == "starting" and stored.handle is None:
                    # in a restart's back-off: no process to stop
                    self.recorder.event(stored, "stopped", reason="stopped during restart back-off")
                    stored.restart_attempts = 0
                return tx.put_machine(stored, "stop"), stored.machine.state == "stopping"

            stored, must_wait = await self.recorder.commit(op)
            self.supervisor.cancel_restart(request.id)
            handle = stored.handle
        if must_wait and handle is not None:
            if frozen[0]:  # continued just before its stop signal: a frozen process would not act on it
                await self.driver.signal(handle, signals.SIGCONT)
            await self.driver.stop(handle, request.timeout, signum)
            return await self.wait_for(request.id, {"stopped", "failed", "destroyed"}, timeout=10.0)
        return self.view(self.require(request.id))

    async def signal(self, request: SignalRequest) -> Machine:
        signum = parse_signal(request.signal)
        stored = self.require(request.id)
        leases.check(stored, request.lease_nonce, self.clock())
        if stored.machine.state != "started" or stored.handle is None:
            raise Conflict(f"machine {request.id} is {stored.machine.state}; only a started machine takes signals")
        await self.driver.signal(stored.handle, signum)
        return self.view(stored)

    async def suspend(self, request: SuspendRequest) -> Machine:
        """Freeze a started machine's process group (workers/lifecycle/pause.py)."""
        return await self.pauses.suspend(request)

    async def resume(self, request: ResumeRequest) -> Machine:
        """Continue a suspended machine, answered before its record (workers/lifecycle/pause.py)."""
        return await self.pauses.resume(request)

    async def exec(self, request: ExecRequest) -> ExecReply:
        """Run a command in a started machine's environment, working directory and limits (no state change)."""
        stored = self.require(request.id)
        if stored.machine.state != "started" or stored.handle is None:
            raise Conflict(f"machine {request.id} is {stored.machine.state}; exec needs a started machine")
        if not isinstance(self.driver, CanExec):
            raise BadRequest(f"the {self.driver.name} driver cannot exec")
        return await self.driver.exec(stored.handle, self.specs.task_spec(stored), [*request.cmd], request.timeout)

    async def destroy(self, request: DestroyRequest, *, source: str = "user") -> Machine:
        async with self.lock(request.id):

            def op(tx: Tx) -> StoredMachine:
                stored = tx.require(request.id)
                leases.check(stored, request.lease_nonce, tx.now)
                state = stored.machine.state
                if state in ("destroyed", "destroying"):
                    return stored
                if state in PROCESS_STATES and not request.force:
                    raise Conflict(f"machine {request.id} is {state}; stop it first or destroy with force")
                stored.desired = "destroyed"
                self.recorder.event(stored, "destroying", source=source, reason="destroy requested")
                return tx.put_machine(stored, "destroy")

            stored = await self.recorder.commit(op)
            if stored.machine.state == "destroyed":
                return self.view(stored)
            self.supervisor.cancel_restart(request.id)
            stored = await self.finish_destroy(stored)
        self.recorder.forget(request.id)
        return self.view(stored)

    async def finish_destroy(self, stored: StoredMachine) -> StoredMachine:
        """Kill a `destroying` machine's process and record `destroyed` (caller holds the lock)."""
        machine_id = stored.machine.id
        handle = stored.handle
        self.supervisor.stop_checks(machine_id)
        info: ExitInfo | None = None
        if handle is not None:
            running = self.driver.recover(handle)
            await self.driver.destroy(handle, force=True)
            if running:
                try:  # bounded: a destroy holds the machine's lock, and nothing may wait behind it forever
                    status = await asyncio.wait_for(self.driver.wait(handle), DESTROY_WAIT)
                    info = exit_info(status, True, read_stderr_tail(handle.stderr_path), self.clock)
                except TimeoutError:
                    log.warning("machine %s: its process did not end after the kill; recorded destroyed", machine_id)

        def op(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            if info is not None:
                current.machine.exit = info
            current.handle = None
            current.machine.lease = None
            current.machine.checks = {}
            self.recorder.event(current, "destroyed", reason="destroyed")
            detach(tx, current.machine)  # in the same commit: its volumes are free once it is gone
            return tx.put_machine(current, "destroyed")

        result: StoredMachine = await self.recorder.commit(op)
        return result

    # ------------------------------------------------------------------------------------------
    # update: a new config (and instance id); a running machine is replaced in place

    async def update(self, request: UpdateRequest) -> Machine:
        update.check(request, self.config.worker_id)
        async with self.lock(request.id):
            stored, running = await self.recorder.commit(update.op(request, self.config, self.recorder))
            self.supervisor.cancel_restart(request.id)
            if not running:
                return self.view(stored)
            handle = stored.handle
            if handle is not None:
                self.supervisor.stop_checks(request.id)
                await self.driver.stop(handle, request.timeout, signals.SIGTERM)
            stored = await self.recorder.commit(update.restart_op(request, self.recorder))
            stored = await self.launch(stored)
            return self.view(stored)

    # ------------------------------------------------------------------------------------------
    # restart of the worker, and shutdown

    async def readopt(self) -> dict[str, int]:
        """Finish every transition in flight when the worker stopped; returns counts per outcome."""
        return await resume_in_flight(self, stop_timeout=self.config.stop_timeout)

    async def close(self) -> None:
        """Make the records of resumes already answered (`RESUME_RECORD_DELAY` away), then stop watching
        (machines keep running: a worker restart must not kill them)."""
        await self.pauses.close()
        await self.supervisor.close()
