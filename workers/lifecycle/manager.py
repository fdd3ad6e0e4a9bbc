"""The machine manager: every lifecycle verb, each one a checked transition committed before it is told.

It knows nothing of NATS. Verbs come in as request Structs and leave as `Machine`s or
`FauxmadError`s; every state change goes through the `Recorder` (one lock per machine, a checked
transition, one `put_machine` in a group-committed LMDB transaction, then `on_commit`: the agent
publishes events and index updates from there). So verbs, process exits and restarts of one
machine never interleave, and different machines never wait for each other.

This module holds the verbs and nothing else: what happens once a process runs (its exit, restarts,
health checks) is the `Supervisor`'s, and finishing what was in flight when the worker died is
`resume`'s. Both call back here only for what a verb owns: the task spec a process runs with, a
launch, a destroy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal as signals
import time
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from bus.contract.base import State
from bus.contract.errors import BadRequest, Conflict, DeadlineExceeded, NoCapacity, NotFound
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
    MachineConfig,
    MachineEvent,
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
from bus.stores.images import is_digest
from workers.driver import sandbox
from workers.driver.base import Driver, TaskHandle, TaskSpec
from workers.image_cache import ImageCache, Pulled
from workers.lifecycle import steps
from workers.lifecycle.exits import exit_info, read_stderr_tail
from workers.lifecycle.fence import Fence
from workers.lifecycle.recorder import CommitHook, Recorder
from workers.lifecycle.restart_policy import Backoff
from workers.lifecycle.resume import resume_in_flight
from workers.lifecycle.signals import parse_signal
from workers.lifecycle.supervisor import Supervisor
from workers.log.commit import GroupCommitter
from workers.log.machine_states import PROCESS_STATES, STARTABLE
from workers.log.records import StoredMachine
from workers.log.stamps import iso, new_instance_id, pick_port
from workers.log.store import Store, Tx
from workers.volumes.verbs import VolumeManager, attach, detach

log = logging.getLogger(__name__)

# seconds between a resume's answer and its record: the request the machine was resumed for is answered 1 to
# 3 ms after the signal (recorded at once, the commit and its event competed with it: the first byte through
# the proxy had p50s of 2.7-3.4 ms in `fauxmad bench proxy`, 2.3-3.1 ms with this delay)
RESUME_RECORD_DELAY = 0.005
DESTROY_WAIT = 15.0  # seconds a destroy waits for its process to end after the kill (the driver kills harder at 5)


@runtime_checkable
class CanExec(Protocol):
    """A driver that can run a command beside a machine's workload (the process driver can)."""

    async def exec(self, handle: TaskHandle, spec: TaskSpec, cmd: list[str], timeout: float) -> ExecReply: ...


class ManagerConfig(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    region: str
    cpus: int
    memory_mb: int
    data_dir: str
    backoff: Backoff = Backoff()
    check_host: str = "127.0.0.1"  # local: a worker's health check runs on the machine's own host
    stop_timeout: float = 10.0
    run_as: tuple[int, int] | None = None  # (uid, gid) of the worker's --machine-user
    address: str | None = None  # the worker's advertised address, shown on each of its machines


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
        images: ImageCache | None = None,
        volumes: VolumeManager | None = None,
        fence: Fence | None = None,
        clock: Callable[[], float] = time.time,
        skewed: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.config = config
        self.skewed = skewed  # why this worker's clock is too far off to reserve anything (its heartbeat measures)
        self.fence = fence  # keyed machines reserved before an absence run only if still the key's
        self.store = store
        self.driver = driver
        self.on_launch = on_launch  # right before a process is spawned (the agent follows its logs from there)
        self.secret_env = secret_env  # the app's secrets in clear, for the environment only (workers/secrets.py)
        self.held_ports = held_ports  # ports of this worker's machines not destroyed: a create passes them over
        self.images = images  # machines whose config.image is a digest run in their unpacked image
        # machines with config.mounts run with those volumes (docs/tutorials/images-and-volumes.md)
        self.volumes = volumes
        self.clock = clock
        self.inflight = 0
        # resumes answered, their records being made: reads show these machines `started` already, as the
        # resume's answer did (read your writes), and the task is kept from the garbage collector
        self._resuming: dict[str, asyncio.Task[None]] = {}
        self.recorder = Recorder(committer, on_commit=on_commit, clock=clock)
        self.supervisor = Supervisor(
            self, self.recorder, store, driver, backoff=config.backoff, check_host=config.check_host
        )

    # ------------------------------------------------------------------------------------------
    # reads

    def _state(self, machine: Machine) -> State:
        """The state reads show: a resumed machine is `started` from its answer on; its record follows
        within milliseconds."""
        if machine.id in self._resuming and machine.state in ("suspended", "suspending"):
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

    def _lock(self, machine_id: str) -> asyncio.Lock:
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

    def _check_lease(self, stored: StoredMachine, nonce: str | None, now: float) -> None:
        lease = stored.machine.lease
        if lease is None or lease.expires_at <= now or lease.nonce == nonce:
            return
        holder = f" by {lease.holder}" if lease.holder else ""
        raise Conflict(f"machine {stored.machine.id} is leased{holder} for {lease.expires_at - now:.1f}s more")

    async def lease(self, request: LeaseRequest) -> Lease:
        def op(tx: Tx) -> Lease:
            stored = tx.require(request.id)
            if stored.machine.state == "destroyed":
                raise Conflict(f"machine {request.id} is destroyed")
            current = stored.machine.lease
            if current is not None and current.expires_at > tx.now and current.nonce != request.nonce:
                self._check_lease(stored, request.nonce, tx.now)
            nonce = request.nonce if current is not None and current.nonce == request.nonce else secrets.token_hex(8)
            stored.machine.lease = Lease(nonce=nonce, holder=request.holder, expires_at=tx.now + request.ttl)
            tx.put_machine(stored, "lease")
            return stored.machine.lease

        result: Lease = await self.recorder.commit(op)
        return result

    async def release(self, request: ReleaseRequest) -> Machine:
        def op(tx: Tx) -> StoredMachine:
            stored = tx.require(request.id)
            lease = stored.machine.lease
            if lease is None or lease.expires_at <= tx.now:
                stored.machine.lease = None
                return stored
            if lease.nonce != request.nonce:
                raise Conflict(f"machine {request.id}: lease nonce does not match")
            stored.machine.lease = None
            tx.put_machine(stored, "release")
            return stored

        return self.view(await self.recorder.commit(op))

    # ------------------------------------------------------------------------------------------
    # reserve

    async def reserve(self, request: ReserveRequest) -> Machine:
        """Record the machine (`created`), or with `launch` record it `starting` in the same commit and start
        it before answering: one request and two commits for a create+start instead of two and three."""
        if request.region != self.config.region:
            raise BadRequest(f"worker {self.config.worker_id} is in region {self.config.region}, not {request.region}")
        request.config.require_command()
        self._check_workdir(request.config)
        try:
            sandbox.check(request.config.guest.sandbox, self.config.worker_id)
        except sandbox.SandboxUnavailable as exc:  # a refusal: the broker moves on to a worker that has it
            raise NoCapacity(str(exc)) from None
        machine_id = request.id or new_machine_id()
        port = pick_port(self.held_ports())
        mark = self.fence.mark() if self.fence is not None else 0

        def op(tx: Tx) -> tuple[StoredMachine, bool]:
            if request.idempotency_key:
                existing = tx.by_idempotency(request.idempotency_key)
                # the key's machine here, if this reserve is for it: not another app's that used the same key,
                # nor a copy the key's claim fenced off (the reserve then names the key's newer machine id)
                if existing is not None and self._same_reservation(existing, request):
                    return existing, False
            held = tx.get(machine_id)
            if held is not None:
                if held.machine.app != request.app or held.idempotency_key != request.idempotency_key:
                    raise Conflict(f"machine {machine_id} exists already")
                return held, False  # the same reservation again (a broker's retry or probe): answer with it
            self._check_room(tx, request, machine_id)
            stored = self._new_record(request, machine_id, port, tx.now)
            attach(tx, stored.machine)  # its volumes are its own from this commit on, or nothing is reserved
            if request.launch:
                self.recorder.event(stored, "starting", source="user", reason="start requested")
                stored.desired = "started"
            return tx.put_machine(stored, "reserve"), True

        stored, reserved = await self.recorder.commit(op)
        steps.reached("reserve.committed")
        if reserved and request.launch:
            stored = await self._launch_reserved(machine_id, mark)
        return self.view(stored)

    @staticmethod
    def _same_reservation(existing: StoredMachine, request: ReserveRequest) -> bool:
        return existing.machine.app == request.app and request.id in (None, existing.machine.id)

    def _check_room(self, tx: Tx, request: ReserveRequest, machine_id: str) -> None:
        """Refuse a reserve this worker must not commit: expired, cordoned, or no room (all in the commit)."""
        skewed = self.skewed()
        if skewed is not None:  # its clock decides whether a reserve expired: with it off, nothing is safe
            raise NoCapacity(skewed)
        if request.expires_at is not None and tx.now > request.expires_at:
            # the broker has given up on this reserve and may place elsewhere: never commit it late
            raise DeadlineExceeded(f"reservation of {machine_id} expired before it was committed: nothing reserved")
        if tx.worker().cordoned:
            raise NoCapacity(f"worker {self.config.worker_id} is cordoned")
        guest = request.config.guest
        usage = tx.usage()
        if usage.cpus + guest.cpus > self.config.cpus or usage.memory_mb + guest.memory_mb > self.config.memory_mb:
            raise NoCapacity(
                f"worker {self.config.worker_id} is full: needs {guest.cpus} cpus/{guest.memory_mb} MB, "
                f"{self.config.cpus - usage.cpus} cpus/{self.config.memory_mb - usage.memory_mb} MB free"
            )

    def _new_record(self, request: ReserveRequest, machine_id: str, port: int, now: float) -> StoredMachine:
        """A reserved machine (`created`) with its first event, which keeps the placement's explanation."""
        stamp = iso(now)
        instance_id = new_instance_id(now)
        stored = StoredMachine(
            machine=Machine(
                id=machine_id,
                name=request.name or f"{request.app}-{machine_id[:6]}",
                app=request.app,
                region=request.region,
                worker_id=self.config.worker_id,
                state="created",
                config=request.config,
                instance_id=instance_id,
                created_at=stamp,
                updated_at=stamp,
                port=port,
                address=self.config.address,
            ),
            idempotency_key=request.idempotency_key,
        )
        stored.events.append(
            MachineEvent(
                type="transition",
                status="created",
                source="user",
                reason="reserved",
                timestamp=round(now * 1000, 3),
                machine_id=machine_id,
                app=request.app,
                region=request.region,
                worker_id=self.config.worker_id,
                metadata=dict(request.config.metadata),
                instance_id=instance_id,
                placement=request.placement,
                audit=request.audit,
            )
        )
        return stored

    async def _launch_reserved(self, machine_id: str, mark: int) -> StoredMachine:
        """Start a machine just reserved `starting` (a stop or destroy may have come first: then leave it).

        If this worker was away since the reserve arrived (`mark`), a keyed machine first asks its claim: the
        broker may have fenced this worker and placed the key's machine elsewhere meanwhile (the fence)."""
        async with self._lock(machine_id):
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
                async with self._lock(stored.machine.id):
                    current = self.require(stored.machine.id)
                    if current.machine.state not in ("destroyed", "destroying"):
                        await self._fence_off(current)
        return counts

    # ------------------------------------------------------------------------------------------
    # start

    async def start(self, request: StartRequest) -> Machine:
        async with self._lock(request.id):

            def op(tx: Tx) -> tuple[StoredMachine, bool]:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
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

    async def _image_for(self, image: str | None) -> Pulled | None:
        """The machine's image on this host (pulled and unpacked first if needed), if it names one by digest."""
        if self.images is None or not is_digest(image):
            return None
        assert image is not None
        return await self.images.ensure(image)

    def task_spec(self, stored: StoredMachine) -> TaskSpec:
        """What the driver runs for this machine; checks and `exec` run in the same environment."""
        machine = stored.machine
        env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TZ") if key in os.environ}
        digest = machine.config.image
        image = self.images.ready(digest) if self.images is not None and digest and is_digest(digest) else None
        sandbox = machine.config.guest.sandbox
        # a machine runs as the worker's --machine-user, but in a sandbox, whose mounts already hide the worker's files
        run_as = self.config.run_as if sandbox == "none" else None
        home = str(self.workdir(machine.id)) if run_as is None else str(self.workdir(machine.id) / "home")
        if image is not None or run_as is not None:  # it writes to its own directory
            env.update(image.manifest.env if image is not None and image.manifest else {})
            env.update({"HOME": home, "TMPDIR": home})
        env.update(machine.config.env)
        env.update(self.secret_env(machine.app))
        env.update(
            {
                "PORT": str(machine.port),
                "FAUXMAD_MACHINE_ID": machine.id,
                "FAUXMAD_APP": machine.app,
                "FAUXMAD_REGION": machine.region,
                "FAUXMAD_WORKER_ID": machine.worker_id,
                "FAUXMAD_INSTANCE_ID": machine.instance_id,
            }
        )
        volumes = volume_paths(self.volumes, machine)
        for index, (host, path) in enumerate(volumes):  # a sandbox has it at its path; else the host's directory
            seen = path if sandbox != "none" else host
            if index == 0:
                env["FAUXMAD_VOLUME_PATH"] = seen
            env[f"FAUXMAD_VOLUME_{index}"] = seen
        return TaskSpec(
            machine_id=machine.id,
            cmd=list(machine.config.cmd),
            env=env,
            workdir=str(self.workdir(machine.id)),
            memory_mb=machine.config.guest.memory_mb,
            cpus=machine.config.guest.cpus,
            cwd=str(image.workdir) if image is not None else machine.config.workdir,
            sandbox=sandbox,
            image_root=str(image.root) if image is not None else None,
            run_as=run_as,
            volumes=volumes,
        )

    def _check_workdir(self, config: MachineConfig) -> None:
        """`config.workdir` must be a directory on this host (until images ship an app's files)."""
        if config.workdir is not None and not Path(config.workdir).is_dir():
            raise BadRequest(f"config.workdir: {config.workdir} is not a directory on worker {self.config.worker_id}")

    def workdir(self, machine_id: str) -> Path:
        return Path(self.config.data_dir) / "machines" / machine_id

    async def launch(self, stored: StoredMachine) -> StoredMachine:
        """Spawn the process of a `starting` machine and record `started` (caller holds the lock)."""
        machine_id = stored.machine.id
        self.on_launch(stored.machine)
        self.inflight += 1
        pulled = None
        try:
            pulled = await self._image_for(stored.machine.config.image)
            for mount in stored.machine.config.mounts:  # mounted (again, after a host reboot) before it runs
                if self.volumes is None:
                    raise RuntimeError("this worker has no volumes")
                await self.volumes.ready(mount.volume)
            handle = await self.driver.start(self.task_spec(stored))
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
        async with self._lock(request.id):

            def op(tx: Tx) -> tuple[StoredMachine, bool]:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
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
        self._check_lease(stored, request.lease_nonce, self.clock())
        if stored.machine.state != "started" or stored.handle is None:
            raise Conflict(f"machine {request.id} is {stored.machine.state}; only a started machine takes signals")
        await self.driver.signal(stored.handle, signum)
        return self.view(stored)

    # ------------------------------------------------------------------------------------------
    # suspend, resume: freeze a started machine's process group and continue it (an edge proxy's
    # `auto_stop = "suspend"`): it keeps its memory, its port and its reservation, and comes back in
    # about a millisecond plus one commit, where a start would run the program again

    async def suspend(self, request: SuspendRequest) -> Machine:
        async with self._lock(request.id):

            def mark(tx: Tx) -> StoredMachine:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
                if stored.machine.state in ("suspending", "suspended"):
                    return stored
                if stored.machine.state != "started" or stored.handle is None:
                    raise Conflict(f"machine {request.id} is {stored.machine.state}; only a started machine suspends")
                self.recorder.event(stored, "suspending", source="user", reason="suspend requested")
                return tx.put_machine(stored, "suspend")

            stored = await self.recorder.commit(mark)
            if stored.machine.state == "suspended":
                return self.view(stored)
            return self.view(await self.freeze(stored))

    async def freeze(self, stored: StoredMachine) -> StoredMachine:
        """SIGSTOP the process group, then record `suspended` (also how a worker restart finishes one)."""
        assert stored.handle is not None
        self.supervisor.stop_checks(stored.machine.id)
        await self.driver.signal(stored.handle, signals.SIGSTOP)

        def frozen(tx: Tx) -> StoredMachine:
            current = tx.require(stored.machine.id)
            if current.machine.state == "suspending":
                self.recorder.event(current, "suspended", reason="process group stopped (SIGSTOP)")
                return tx.put_machine(current, "suspended")
            return current  # it exited meanwhile: the supervisor has recorded that

        return await self.recorder.commit(frozen)

    async def resume(self, request: ResumeRequest) -> Machine:
        """SIGCONT, answer `started`, then record it. The answer does not wait for the record (an fsync'd
        commit, most of a resume's time: an edge proxy holds a request on it): the kernel already holds the
        fact, and a worker that dies before the record finds a `suspended` machine whose process runs and
        records it `started` (workers/lifecycle/resume.py: for a suspended machine the process's word wins). The
        record is made `RESUME_RECORD_DELAY` later, once the machine has answered the request it was
        resumed for: its commit and the event it publishes would take the cores the machine, NATS and the
        proxy need right then. The machine's lock is held until the record is made, so whatever comes next
        sees `started`."""
        lock = self._lock(request.id)
        await lock.acquire()
        handed_over = False  # to the task that records the resume, which releases the lock when done
        try:
            stored = self.require(request.id)
            self._check_lease(stored, request.lease_nonce, self.clock())
            if stored.machine.state == "started":
                return self.view(stored)
            if stored.machine.state not in ("suspended", "suspending") or stored.handle is None:
                raise Conflict(f"machine {request.id} is {stored.machine.state}; only a suspended machine resumes")
            await self.driver.signal(stored.handle, signals.SIGCONT)
            answer = msgspec.structs.replace(self.view(stored), state="started")
            self._resuming[request.id] = asyncio.create_task(self._record_resume(request.id, lock))
            handed_over = True
            return answer
        finally:
            if not handed_over:
                lock.release()

    async def _record_resume(self, machine_id: str, lock: asyncio.Lock) -> None:
        try:
            await asyncio.sleep(RESUME_RECORD_DELAY)
            await self.record_resumed(machine_id, "resumed (SIGCONT)")
        except Exception:
            log.exception("machine %s: resumed, but recording it failed (a restart records it)", machine_id)
        finally:
            self._resuming.pop(machine_id, None)
            lock.release()

    async def record_resumed(self, machine_id: str, reason: str) -> StoredMachine:
        """Record a suspended machine whose process was continued as `started`, and resume its checks (the
        caller holds the machine's lock): after a resume, and by a restart that finds one it did not record."""

        def thawed(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            if current.machine.state in ("suspended", "suspending"):
                self.recorder.event(current, "started", source="user", reason=reason)
                return tx.put_machine(current, "resume")
            return current

        stored = await self.recorder.commit(thawed)
        if stored.machine.state == "started":
            self.supervisor.start_checks(stored)
        return stored

    async def exec(self, request: ExecRequest) -> ExecReply:
        """Run a command in a started machine's environment, working directory and limits (no state change)."""
        stored = self.require(request.id)
        if stored.machine.state != "started" or stored.handle is None:
            raise Conflict(f"machine {request.id} is {stored.machine.state}; exec needs a started machine")
        if not isinstance(self.driver, CanExec):
            raise BadRequest(f"the {self.driver.name} driver cannot exec")
        return await self.driver.exec(stored.handle, self.task_spec(stored), [*request.cmd], request.timeout)

    async def destroy(self, request: DestroyRequest, *, source: str = "user") -> Machine:
        async with self._lock(request.id):

            def op(tx: Tx) -> StoredMachine:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
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
        request.config.require_command()
        self._check_workdir(request.config)
        try:
            sandbox.check(request.config.guest.sandbox, self.config.worker_id)
        except sandbox.SandboxUnavailable as exc:
            raise BadRequest(str(exc)) from None
        async with self._lock(request.id):

            def op(tx: Tx) -> tuple[StoredMachine, bool]:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
                state = stored.machine.state
                if state in ("destroying", "destroyed", "stopping", "replacing"):
                    raise Conflict(f"machine {request.id} is {state}; it cannot be updated now")
                if request.config.mounts != stored.machine.config.mounts:
                    raise Conflict("config.mounts cannot change in an update: a volume stays with its machine")
                old, new = stored.machine.config.guest, request.config.guest
                usage = tx.usage()
                if usage.cpus - old.cpus + new.cpus > self.config.cpus or (
                    usage.memory_mb - old.memory_mb + new.memory_mb > self.config.memory_mb
                ):
                    raise NoCapacity(f"worker {self.config.worker_id} has no room for the new guest size")
                running = state in ("started", "starting")
                if running and only_labels_differ(stored.machine.config, request.config):
                    # metadata and standbys label a machine; changing them needs no new instance
                    stored.machine.config = request.config
                    self.recorder.event(
                        stored, "update", source="user", reason="metadata updated in place (no restart)", kind="update"
                    )
                    return tx.put_machine(stored, "update"), False
                if running:
                    self.recorder.event(stored, "replacing", source="user", reason="update requested")
                else:
                    self._apply_config(stored, request, tx.now)
                return tx.put_machine(stored, "update" if not running else "replacing"), running

            stored, running = await self.recorder.commit(op)
            self.supervisor.cancel_restart(request.id)
            if not running:
                return self.view(stored)
            handle = stored.handle
            if handle is not None:
                self.supervisor.stop_checks(request.id)
                await self.driver.stop(handle, request.timeout, signals.SIGTERM)

            def restart(tx: Tx) -> StoredMachine:
                current = tx.require(request.id)
                self._apply_config(current, request, tx.now)
                current.handle = None
                current.restart_attempts = 0
                current.desired = "started"
                self.recorder.event(current, "starting", reason="starting the updated config")
                return tx.put_machine(current, "update")

            stored = await self.recorder.commit(restart)
            stored = await self.launch(stored)
            return self.view(stored)

    def _apply_config(self, stored: StoredMachine, request: UpdateRequest, now: float) -> None:
        stored.machine.config = request.config
        stored.machine.instance_id = new_instance_id(now)
        stored.machine.checks = {}
        self.recorder.event(
            stored,
            "update",
            source="user",
            reason=f"config updated (instance {stored.machine.instance_id})",
            kind="update",
        )

    # ------------------------------------------------------------------------------------------
    # restart of the worker, and shutdown

    async def readopt(self) -> dict[str, int]:
        """Finish every transition in flight when the worker stopped; returns counts per outcome."""
        return await resume_in_flight(self, stop_timeout=self.config.stop_timeout)

    async def close(self) -> None:
        """Make the records of resumes already answered (`RESUME_RECORD_DELAY` away), then stop watching
        (machines keep running: a worker restart must not kill them)."""
        if self._resuming:
            await asyncio.gather(*self._resuming.values(), return_exceptions=True)
        await self.supervisor.close()


def volume_paths(volumes: VolumeManager | None, machine: Machine) -> list[tuple[str, str]]:
    """(host directory, mount path) of each of the machine's volumes."""
    if volumes is None:
        return []
    return [(str(volumes.host_path(m.volume)), m.path) for m in machine.config.mounts]


def only_labels_differ(old: MachineConfig, new: MachineConfig) -> bool:
    """True when two configs differ at most in `metadata` and `standbys`, which a running process never sees."""
    unlabel: dict[str, Any] = {"metadata": {}, "standbys": []}
    return msgspec.structs.replace(old, **unlabel) == msgspec.structs.replace(new, **unlabel)
