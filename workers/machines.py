"""The machine manager: every lifecycle verb, each one a checked transition committed before it is told.

It knows nothing of NATS. Verbs come in as request Structs and leave as `Machine`s or
`FauxmadError`s; every state change is one `put_machine` in a group-committed LMDB transaction
and is handed to `on_commit` (the agent publishes events and index updates from there). A lock per
machine serialises that machine's verbs, process exits and restarts, so they never interleave;
different machines never wait for each other.

Process exits are handled in one place (`_on_exit`), whoever caused them: a stop request, a crash,
the OOM killer, or a restart of the worker that found the process gone. `resume` runs at start-up
and finishes every transition that was in flight when the worker died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal as signals
import socket
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from bus.errors import BadRequest, Conflict, DeadlineExceeded, NoCapacity, NotFound
from bus.ids import new_machine_id
from bus.messages import (
    CheckStatus,
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
    SignalRequest,
    StartRequest,
    StopRequest,
    UpdateRequest,
    WaitRequest,
    seconds,
)
from workers.checks import run_check
from workers.driver import Driver, ExitStatus, TaskHandle, TaskSpec
from workers.lifecycle import PROCESS_STATES, STARTABLE, check_transition
from workers.records import LogRecord, StoredMachine
from workers.store import GroupCommitter, Store, Tx
from workers.supervision import STDERR_TAIL_BYTES, Backoff, after_exit, describe_exit, tail_lines

log = logging.getLogger(__name__)

CommitHook = Callable[[list[LogRecord]], None]


@runtime_checkable
class CanExec(Protocol):
    """A driver that can run a command beside a machine's workload (the process driver can)."""

    async def exec(self, handle: TaskHandle, spec: TaskSpec, cmd: list[str], timeout: float) -> ExecReply: ...


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_instance_id(now: float) -> str:
    """A ULID (time-sortable, 26 Crockford base32 chars), as Fly uses for instance ids."""
    value = (int(now * 1000) << 80) | int.from_bytes(secrets.token_bytes(10), "big")
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def parse_signal(name: str) -> int:
    text = name.strip().upper()
    if text.isdigit():
        # ASCII digits only, and few: int() refuses '²' (a digit to isdigit) and over 4,300 digits (a 500),
        # and reads '٣' as 3 (SIGQUIT, which no caller meant)
        number = int(text) if text.isascii() and len(text) <= 3 else 0
        if 0 < number < signals.NSIG:
            return number
    else:
        if not text.startswith("SIG"):
            text = "SIG" + text
        value = getattr(signals.Signals, text, None)
        if isinstance(value, signals.Signals):
            return int(value)
    raise BadRequest(f"unknown signal {name!r}")


def read_stderr_tail(path: Path) -> list[str]:
    """The last lines of a machine's stderr log (`ExitInfo.stderr_tail`): a bounded read of the file's end."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - STDERR_TAIL_BYTES)
            f.seek(start)
            data = f.read(STDERR_TAIL_BYTES)
    except OSError:
        return []
    return tail_lines(data, whole=start == 0)


def pick_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ManagerConfig(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    region: str
    cpus: int
    memory_mb: int
    data_dir: str
    backoff: Backoff = Backoff()
    check_host: str = "127.0.0.1"
    stop_timeout: float = 10.0


class MachineManager:
    def __init__(
        self,
        config: ManagerConfig,
        store: Store,
        committer: GroupCommitter,
        driver: Driver,
        *,
        on_commit: CommitHook = lambda records: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.committer = committer
        self.driver = driver
        self.on_commit = on_commit
        self.clock = clock
        self.inflight = 0
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._waiters: defaultdict[str, list[tuple[frozenset[str], asyncio.Future[Machine]]]] = defaultdict(list)
        self._tasks: dict[str, set[asyncio.Task[Any]]] = defaultdict(set)
        self._restart_timers: dict[str, asyncio.Task[None]] = {}
        self._supervised: dict[str, TaskHandle] = {}
        self._closing = False

    # ------------------------------------------------------------------------------------------
    # commits

    async def _commit(self, fn: Callable[[Tx], Any]) -> Any:
        result, records = await self.committer.submit(fn)
        if records:
            self._after_commit(records)
        return result

    def _after_commit(self, records: list[LogRecord]) -> None:
        for record in records:
            stored = getattr(record, "stored", None)
            if stored is not None:
                self._notify(stored.machine)
        try:
            self.on_commit(records)
        except Exception:
            log.exception("on_commit hook failed")

    def _notify(self, machine: Machine) -> None:
        waiters = self._waiters.get(machine.id)
        if not waiters:
            return
        remaining = []
        for states, future in waiters:
            if future.done():
                continue
            if machine.state in states:
                future.set_result(machine)
            elif machine.state == "destroyed":
                future.set_exception(Conflict(f"machine {machine.id} was destroyed"))
            else:
                remaining.append((states, future))
        if remaining:
            self._waiters[machine.id] = remaining
        else:
            self._waiters.pop(machine.id, None)

    def _event(
        self,
        stored: StoredMachine,
        to: str,
        *,
        source: str = "worker",
        reason: str | None = None,
        exit: ExitInfo | None = None,
        kind: str = "transition",
        check: CheckStatus | None = None,
    ) -> None:
        """Move `stored` to state `to` (checked) and append the event that says so.

        An `update` event carries the new config's metadata (release, role), so the systemwide view
        learns a machine's labels from the event stream alone.
        """
        machine = stored.machine
        previous = machine.state
        if kind == "transition":
            check_transition(machine.id, previous, to)
            machine.state = to  # type: ignore[assignment]
        now = self.clock()
        machine.updated_at = iso(now)
        stored.events.append(
            MachineEvent(
                type=kind,  # type: ignore[arg-type]
                status=machine.state,
                from_state=previous if kind == "transition" else None,
                source=source,  # type: ignore[arg-type]
                reason=reason,
                exit=exit,
                timestamp=round(now * 1000, 3),
                machine_id=machine.id,
                app=machine.app,
                region=machine.region,
                worker_id=machine.worker_id,
                metadata=dict(machine.config.metadata) if kind == "update" else None,
                check=check,
                instance_id=machine.instance_id,
            )
        )

    # ------------------------------------------------------------------------------------------
    # reads

    def view(self, stored: StoredMachine, *, events: bool = False) -> Machine:
        machine = msgspec.structs.replace(stored.machine)
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
        return self._locks[machine_id]

    def get(self, request: GetRequest) -> Machine:
        return self.view(self.require(request.id), events=request.events)

    def list(self, request: ListRequest) -> list[Machine]:
        out = []
        for stored in self.store.machines():
            machine = stored.machine
            if request.app and machine.app != request.app:
                continue
            if request.state and machine.state != request.state:
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
        future: asyncio.Future[Machine] = asyncio.get_running_loop().create_future()
        self._waiters[machine_id].append((wanted, future))
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

        result: Lease = await self._commit(op)
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

        return self.view(await self._commit(op))

    # ------------------------------------------------------------------------------------------
    # reserve

    async def reserve(self, request: ReserveRequest) -> Machine:
        if request.region != self.config.region:
            raise BadRequest(f"worker {self.config.worker_id} is in region {self.config.region}, not {request.region}")
        if not request.config.cmd:
            raise BadRequest("config.cmd is required: the process driver needs a command to run")
        self._check_workdir(request.config)
        guest = request.config.guest
        machine_id = request.id or new_machine_id()
        port = pick_port()

        def op(tx: Tx) -> StoredMachine:
            if request.idempotency_key:
                existing = tx.by_idempotency(request.idempotency_key)
                if existing is not None:
                    return existing
            held = tx.get(machine_id)
            if held is not None:
                if held.machine.app != request.app or held.idempotency_key != request.idempotency_key:
                    raise Conflict(f"machine {machine_id} exists already")
                return held  # the same reservation again (a broker's retry or probe): answer with it
            if request.expires_at is not None and tx.now > request.expires_at:
                # the broker has given up on this reserve and may place elsewhere: never commit it late
                raise DeadlineExceeded(f"reservation of {machine_id} expired before it was committed: nothing reserved")
            if tx.worker().cordoned:
                raise NoCapacity(f"worker {self.config.worker_id} is cordoned")
            usage = tx.usage()
            if usage.cpus + guest.cpus > self.config.cpus or usage.memory_mb + guest.memory_mb > self.config.memory_mb:
                raise NoCapacity(
                    f"worker {self.config.worker_id} is full: needs {guest.cpus} cpus/{guest.memory_mb} MB, "
                    f"{self.config.cpus - usage.cpus} cpus/{self.config.memory_mb - usage.memory_mb} MB free"
                )
            stamp = iso(tx.now)
            instance_id = new_instance_id(tx.now)
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
                ),
                idempotency_key=request.idempotency_key,
            )
            stored.events.append(
                MachineEvent(
                    type="transition",
                    status="created",
                    source="user",
                    reason="reserved",
                    timestamp=round(tx.now * 1000, 3),
                    machine_id=machine_id,
                    app=request.app,
                    region=request.region,
                    worker_id=self.config.worker_id,
                    metadata=dict(request.config.metadata),
                    instance_id=instance_id,
                    placement=request.placement,
                )
            )
            return tx.put_machine(stored, "reserve")

        return self.view(await self._commit(op))

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
                self._event(stored, "starting", source="user", reason="start requested")
                stored.desired = "started"
                stored.restart_attempts = 0
                return tx.put_machine(stored, "start"), True

            stored, changed = await self._commit(op)
            if changed:
                stored = await self._launch(stored)
            return self.view(stored)

    def _task_spec(self, stored: StoredMachine) -> TaskSpec:
        machine = stored.machine
        env = {key: os.environ[key] for key in ("PATH", "HOME", "LANG", "TZ") if key in os.environ}
        env.update(machine.config.env)
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
        return TaskSpec(
            machine_id=machine.id,
            cmd=list(machine.config.cmd),
            env=env,
            workdir=str(self.workdir(machine.id)),
            memory_mb=machine.config.guest.memory_mb,
            cpus=machine.config.guest.cpus,
            cwd=machine.config.workdir,
        )

    def _check_workdir(self, config: MachineConfig) -> None:
        """`config.workdir` must be a directory on this host (until images ship an app's files)."""
        if config.workdir is not None and not Path(config.workdir).is_dir():
            raise BadRequest(f"config.workdir: {config.workdir} is not a directory on worker {self.config.worker_id}")

    def workdir(self, machine_id: str) -> Path:
        return Path(self.config.data_dir) / "machines" / machine_id

    async def _launch(self, stored: StoredMachine) -> StoredMachine:
        """Spawn the process of a `starting` machine and record `started` (caller holds the lock)."""
        machine_id = stored.machine.id
        self.inflight += 1
        try:
            handle = await self.driver.start(self._task_spec(stored))
        except Exception as exc:
            log.warning("machine %s: could not start: %r", machine_id, exc)
            reason = f"could not start: {exc}"

            def failed(tx: Tx) -> StoredMachine:
                current = tx.require(machine_id)
                self._event(current, "failed", reason=reason)
                return tx.put_machine(current, "start_failed")

            result: StoredMachine = await self._commit(failed)
            return result
        finally:
            self.inflight -= 1

        def started(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            current.handle = handle
            self._event(current, "started", reason=f"process {handle.pid} running")
            if current.machine.config.image:
                tx.touch_image(current.machine.config.image)
            return tx.put_machine(current, "started")

        stored = await self._commit(started)
        self._supervise(stored)
        return stored

    # ------------------------------------------------------------------------------------------
    # supervision: exits, restarts, checks

    def _spawn(self, machine_id: str, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        tasks = self._tasks[machine_id]
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    def _supervise(self, stored: StoredMachine) -> None:
        handle = stored.handle
        if handle is None:
            return
        machine_id = stored.machine.id
        self._supervised[machine_id] = handle
        self._spawn(machine_id, self._watch(machine_id, handle))
        for name, check in stored.machine.config.checks.items():
            self._spawn(machine_id, self._check_loop(machine_id, handle, name, check))

    async def _watch(self, machine_id: str, handle: TaskHandle) -> None:
        status = await self.driver.wait(handle)
        if self._closing:
            return
        await self._on_exit(machine_id, handle, status)

    def _exit_info(self, status: ExitStatus, requested: bool, stderr_tail: Iterable[str]) -> ExitInfo:
        return ExitInfo(
            exit_code=status.exit_code,
            signal=status.signal,
            oom_killed=status.oom_killed,
            requested_stop=requested,
            lost=status.lost,
            at=status.finished_at or self.clock(),
            stderr_tail=[*stderr_tail],
        )

    async def _on_exit(self, machine_id: str, handle: TaskHandle, status: ExitStatus) -> None:
        # read here, not in the commit: the process has ended, so its stderr is complete
        stderr_tail = read_stderr_tail(handle.stderr_path)
        async with self._locks[machine_id]:
            decision_box: dict[str, Any] = {}

            def op(tx: Tx) -> StoredMachine | None:
                stored = tx.get(machine_id)
                if stored is None or stored.handle != handle:
                    return None  # a stale watcher: the machine moved on to another process
                state = stored.machine.state
                if state not in ("started", "stopping"):
                    return None  # destroying/replacing: whoever moved it there finishes the job
                requested = state == "stopping"
                info = self._exit_info(status, requested, stderr_tail)
                stored.machine.exit = info
                ran_for = max(0.0, info.at - handle.started_at) if handle.started_at else 0.0
                decision = after_exit(
                    stored.machine.config.restart,
                    status,
                    attempts=stored.restart_attempts,
                    ran_for=ran_for,
                    requested_stop=requested or stored.desired != "started",
                    backoff=self.config.backoff,
                )
                decision_box["decision"] = decision
                self._event(stored, "exit", reason=describe_exit(status), exit=info, kind="exit")
                if decision.restart:
                    stored.restart_attempts = decision.attempt
                    stored.machine.restarts += 1
                    stored.handle = None
                    self._event(stored, "starting", reason=decision.reason)
                    return tx.put_machine(stored, "restart")
                self._event(stored, decision.state, reason=decision.reason)
                stored.desired = decision.state
                stored.handle = None
                stored.machine.checks = {}
                return tx.put_machine(stored, "exit")

            stored = await self._commit(op)
            if stored is None:
                return  # a stale watcher: the checks running now belong to the next process
            self._stop_checks_for(machine_id)
            self._supervised.pop(machine_id, None)
            decision = decision_box["decision"]
            if decision.restart:
                timer = self._spawn(machine_id, self._restart_later(machine_id, decision.delay))
                self._restart_timers[machine_id] = timer
            elif stored.machine.config.auto_destroy:
                self._spawn(machine_id, self._auto_destroy(machine_id))

    async def _restart_later(self, machine_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self._locks[machine_id]:
            self._restart_timers.pop(machine_id, None)
            stored = self.store.get(machine_id)
            if stored is None or stored.machine.state != "starting" or stored.handle is not None:
                return
            await self._launch(stored)

    async def _auto_destroy(self, machine_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.destroy(DestroyRequest(id=machine_id, force=True), source="worker")

    def _cancel_restart(self, machine_id: str) -> None:
        timer = self._restart_timers.pop(machine_id, None)
        if timer is not None:
            timer.cancel()

    def _stop_checks_for(self, machine_id: str) -> None:
        current = asyncio.current_task()
        for task in list(self._tasks.get(machine_id, ())):
            if task is not current and getattr(task, "fauxmad_check", False):
                task.cancel()

    async def _check_loop(self, machine_id: str, handle: TaskHandle, name: str, check: Any) -> None:
        task = asyncio.current_task()
        if task is not None:
            task.fauxmad_check = True  # type: ignore[attr-defined]
        interval, timeout, grace = seconds(check.interval), seconds(check.timeout), seconds(check.grace_period)
        await asyncio.sleep(grace)
        last: str | None = None
        while True:
            stored = self.store.get(machine_id)
            if stored is None or stored.handle != handle or stored.machine.state != "started":
                return
            spec = self._task_spec(stored)
            result = await run_check(
                check.type,
                host=self.config.check_host,
                port=check.port or stored.machine.port,
                path=check.path,
                command=check.command,
                timeout=timeout,
                env=spec.env,
                cwd=spec.run_dir,
            )
            if result.status != last:
                last = result.status
                await self._record_check(machine_id, handle, name, result.status, result.output)
            await asyncio.sleep(interval)

    async def _record_check(self, machine_id: str, handle: TaskHandle, name: str, status: str, output: str) -> None:
        def op(tx: Tx) -> None:
            stored = tx.get(machine_id)
            if stored is None or stored.handle != handle or stored.machine.state != "started":
                return
            check = CheckStatus(name=name, status=status, output=output, updated_at=tx.now)  # type: ignore[arg-type]
            stored.machine.checks[name] = check
            self._event(
                stored,
                "check",
                reason=f"check {name} is {status}: {output}"[:300],
                kind="check",
                check=msgspec.structs.replace(check, output=output[:300]),
            )
            tx.put_machine(stored, "check")

        await self._commit(op)

    # ------------------------------------------------------------------------------------------
    # stop, signal, destroy

    async def stop(self, request: StopRequest) -> Machine:
        signum = parse_signal(request.signal)
        async with self._lock(request.id):

            def op(tx: Tx) -> tuple[StoredMachine, bool]:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
                state = stored.machine.state
                if state in ("stopped", "created", "failed", "stopping"):
                    return stored, state == "stopping"
                if state in ("destroying", "destroyed"):
                    raise Conflict(f"machine {request.id} is {state}; it cannot be stopped")
                stored.desired = "stopped"
                stored.stop_signal = request.signal
                self._event(stored, "stopping", source="user", reason=f"stop requested ({request.signal})")
                if state == "starting" and stored.handle is None:
                    # in a restart's back-off: no process to stop
                    self._event(stored, "stopped", reason="stopped during restart back-off")
                    stored.restart_attempts = 0
                return tx.put_machine(stored, "stop"), stored.machine.state == "stopping"

            stored, must_wait = await self._commit(op)
            self._cancel_restart(request.id)
            handle = stored.handle
        if must_wait and handle is not None:
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

    async def exec(self, request: ExecRequest) -> ExecReply:
        """Run a command in a started machine's environment, working directory and limits (no state change)."""
        stored = self.require(request.id)
        if stored.machine.state != "started" or stored.handle is None:
            raise Conflict(f"machine {request.id} is {stored.machine.state}; exec needs a started machine")
        if not isinstance(self.driver, CanExec):
            raise BadRequest(f"the {self.driver.name} driver cannot exec")
        return await self.driver.exec(stored.handle, self._task_spec(stored), [*request.cmd], request.timeout)

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
                self._event(stored, "destroying", source=source, reason="destroy requested")
                return tx.put_machine(stored, "destroy")

            stored = await self._commit(op)
            if stored.machine.state == "destroyed":
                return self.view(stored)
            self._cancel_restart(request.id)
            stored = await self._finish_destroy(stored)
        self._forget(request.id)
        return self.view(stored)

    async def _finish_destroy(self, stored: StoredMachine) -> StoredMachine:
        machine_id = stored.machine.id
        handle = stored.handle
        self._stop_checks_for(machine_id)
        exit_info: ExitInfo | None = None
        if handle is not None:
            running = self.driver.recover(handle)
            await self.driver.destroy(handle, force=True)
            if running:
                exit_info = self._exit_info(await self.driver.wait(handle), True, read_stderr_tail(handle.stderr_path))

        def op(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            if exit_info is not None:
                current.machine.exit = exit_info
            current.handle = None
            current.machine.lease = None
            current.machine.checks = {}
            self._event(current, "destroyed", reason="destroyed")
            return tx.put_machine(current, "destroyed")

        result: StoredMachine = await self._commit(op)
        return result

    def _forget(self, machine_id: str) -> None:
        self._supervised.pop(machine_id, None)
        lock = self._locks.get(machine_id)
        if lock is not None and not lock.locked():
            self._locks.pop(machine_id, None)

    # ------------------------------------------------------------------------------------------
    # update: a new config (and instance id); a running machine is replaced in place

    async def update(self, request: UpdateRequest) -> Machine:
        if not request.config.cmd:
            raise BadRequest("config.cmd is required: the process driver needs a command to run")
        self._check_workdir(request.config)
        async with self._lock(request.id):

            def op(tx: Tx) -> tuple[StoredMachine, bool]:
                stored = tx.require(request.id)
                self._check_lease(stored, request.lease_nonce, tx.now)
                state = stored.machine.state
                if state in ("destroying", "destroyed", "stopping", "replacing"):
                    raise Conflict(f"machine {request.id} is {state}; it cannot be updated now")
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
                    self._event(
                        stored, "update", source="user", reason="metadata updated in place (no restart)", kind="update"
                    )
                    return tx.put_machine(stored, "update"), False
                if running:
                    self._event(stored, "replacing", source="user", reason="update requested")
                else:
                    self._apply_config(stored, request, tx.now)
                return tx.put_machine(stored, "update" if not running else "replacing"), running

            stored, running = await self._commit(op)
            self._cancel_restart(request.id)
            if not running:
                return self.view(stored)
            handle = stored.handle
            if handle is not None:
                self._stop_checks_for(request.id)
                await self.driver.stop(handle, request.timeout, signals.SIGTERM)

            def restart(tx: Tx) -> StoredMachine:
                current = tx.require(request.id)
                self._apply_config(current, request, tx.now)
                current.handle = None
                current.restart_attempts = 0
                current.desired = "started"
                self._event(current, "starting", reason="starting the updated config")
                return tx.put_machine(current, "update")

            stored = await self._commit(restart)
            stored = await self._launch(stored)
            return self.view(stored)

    def _apply_config(self, stored: StoredMachine, request: UpdateRequest, now: float) -> None:
        stored.machine.config = request.config
        stored.machine.instance_id = new_instance_id(now)
        stored.machine.checks = {}
        self._event(
            stored,
            "update",
            source="user",
            reason=f"config updated (instance {stored.machine.instance_id})",
            kind="update",
        )

    # ------------------------------------------------------------------------------------------
    # restart of the worker: finish what was in flight, re-adopt what runs

    async def resume(self) -> dict[str, int]:
        """Finish every transition in flight when the worker stopped; returns counts per outcome."""
        outcomes: dict[str, int] = defaultdict(int)
        for stored in self.store.machines():
            if stored.machine.state not in PROCESS_STATES:
                continue
            try:
                outcome = await self._resume_one(stored)
            except Exception:
                log.exception("machine %s: could not resume", stored.machine.id)
                outcome = "error"
            outcomes[outcome] += 1
        return dict(outcomes)

    async def _resume_one(self, stored: StoredMachine) -> str:
        machine_id = stored.machine.id
        state = stored.machine.state
        handle = stored.handle
        alive = handle is not None and self.driver.recover(handle)
        if state == "destroying":
            async with self._locks[machine_id]:
                await self._finish_destroy(stored)
            return "destroyed"
        if state == "replacing":  # an update was cut short: restart on the config it still has
            async with self._locks[machine_id]:
                if handle is not None and alive:
                    await self.driver.stop(handle, self.config.stop_timeout, signals.SIGTERM)

                def restart(tx: Tx) -> StoredMachine:
                    current = tx.require(machine_id)
                    current.handle = None
                    self._event(current, "starting", reason="worker restarted during an update")
                    return tx.put_machine(current, "resume")

                await self._launch(await self._commit(restart))
            return "relaunched"
        if handle is None:
            if state == "starting":
                async with self._locks[machine_id]:
                    await self._launch(stored)
                return "launched"
            return await self._settle_without_process(stored)
        if alive:
            self._supervise(stored)  # re-adopted: its exit will arrive through the watcher
            if state == "stopping":
                signum = parse_signal(stored.stop_signal)
                self._spawn(machine_id, self.driver.stop(handle, self.config.stop_timeout, signum))
            return "adopted"
        status = await self.driver.wait(handle)  # ended while we were down: the shim left its status
        await self._on_exit(machine_id, handle, status)
        return "exited"

    async def _settle_without_process(self, stored: StoredMachine) -> str:
        machine_id = stored.machine.id

        def op(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            target = "stopped" if current.machine.state == "stopping" else "failed"
            self._event(current, target, reason="worker restarted; no process found")
            return tx.put_machine(current, "resume")

        async with self._locks[machine_id]:
            await self._commit(op)
        return "settled"

    async def close(self) -> None:
        """Stop watching (machines keep running: a worker restart must not kill them)."""
        self._closing = True
        tasks = [task for group in self._tasks.values() for task in group]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def only_labels_differ(old: MachineConfig, new: MachineConfig) -> bool:
    """True when two configs differ at most in `metadata` and `standbys`, which a running process never sees."""
    unlabel: dict[str, Any] = {"metadata": {}, "standbys": []}
    return msgspec.structs.replace(old, **unlabel) == msgspec.structs.replace(new, **unlabel)
