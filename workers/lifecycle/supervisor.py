"""Watching machines' processes: exits, restarts with back-off, auto-destroy, health checks.

Process exits are handled in one place (`on_exit`), whoever caused them: a stop request, a crash,
the OOM killer, or a restart of the worker that found the process gone. What happens next is the
pure `supervision.after_exit` decision; this module only carries it out, under the machine's lock
and through the `Recorder`, like any verb. It asks the machine manager for exactly three things
(`Host`): the task spec a check runs in, a relaunch after back-off, and a destroy.

Every task it starts belongs to a machine, so a destroy or an exit stops that machine's checks, and
`close` stops them all (the processes keep running: a worker restart must not kill them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec

from bus.contract.base import seconds
from bus.contract.machines import Check, CheckStatus, DestroyRequest, Machine
from workers import metrics
from workers.driver.base import Driver, ExitStatus, TaskHandle, TaskSpec
from workers.lifecycle.checks import run_check
from workers.lifecycle.exits import exit_info, read_stderr_tail
from workers.lifecycle.recorder import Recorder
from workers.lifecycle.restart_policy import AfterExit, Backoff, after_exit, describe_exit
from workers.log.records import StoredMachine
from workers.log.store import Store, Tx


class Host(Protocol):
    """What the supervisor asks of the machine manager."""

    def task_spec(self, stored: StoredMachine) -> TaskSpec: ...

    async def launch(self, stored: StoredMachine) -> StoredMachine: ...

    async def destroy(self, request: DestroyRequest, *, source: str = "user") -> Machine: ...


class Supervisor:
    def __init__(
        self,
        host: Host,
        recorder: Recorder,
        store: Store,
        driver: Driver,
        *,
        backoff: Backoff,
        check_host: str,
    ) -> None:
        self.host = host
        self.recorder = recorder
        self.store = store
        self.driver = driver
        self.backoff = backoff
        self.check_host = check_host
        self._tasks: dict[str, set[asyncio.Task[Any]]] = defaultdict(set)
        self._checks: set[asyncio.Task[Any]] = set()
        self._restart_timers: dict[str, asyncio.Task[None]] = {}
        self._closing = False

    def spawn(self, machine_id: str, coro: Coroutine[Any, Any, Any], *, check: bool = False) -> asyncio.Task[Any]:
        """Run `coro` as one of the machine's tasks (`check`: a health-check loop, which exits stop)."""
        task = asyncio.create_task(coro)
        tasks = self._tasks[machine_id]
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if check:
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)
        return task

    def supervise(self, stored: StoredMachine) -> None:
        """Watch the machine's process for its exit, and run its health checks."""
        handle = stored.handle
        if handle is None:
            return
        machine_id = stored.machine.id
        self.spawn(machine_id, self._watch(machine_id, handle))
        self.start_checks(stored)

    def start_checks(self, stored: StoredMachine) -> None:
        """Run the machine's health checks (again, after a resume: they end while it is not `started`)."""
        handle = stored.handle
        if handle is None:
            return
        for name, check in stored.machine.config.checks.items():
            self.spawn(stored.machine.id, self._check_loop(stored.machine.id, handle, name, check), check=True)

    async def close(self) -> None:
        """Stop watching (machines keep running: a worker restart must not kill them)."""
        self._closing = True
        tasks = [task for group in self._tasks.values() for task in group]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------------------------------
    # exits and restarts

    async def _watch(self, machine_id: str, handle: TaskHandle) -> None:
        status = await self.driver.wait(handle)
        if self._closing:
            return
        await self.on_exit(machine_id, handle, status)

    async def on_exit(self, machine_id: str, handle: TaskHandle, status: ExitStatus) -> None:
        # read here, not in the commit: the process has ended, so its stderr is complete
        stderr_tail = read_stderr_tail(handle.stderr_path)
        recorder = self.recorder
        async with recorder.lock(machine_id):
            decision_box: dict[str, AfterExit] = {}

            def op(tx: Tx) -> StoredMachine | None:
                stored = tx.get(machine_id)
                if stored is None or stored.handle != handle:
                    return None  # a stale watcher: the machine moved on to another process
                state = stored.machine.state
                if state not in ("started", "stopping"):
                    return None  # destroying/replacing: whoever moved it there finishes the job
                requested = state == "stopping"
                info = exit_info(status, requested, stderr_tail, recorder.clock)
                stored.machine.exit = info
                ran_for = max(0.0, info.at - handle.started_at) if handle.started_at else 0.0
                decision = after_exit(
                    stored.machine.config.restart,
                    status,
                    attempts=stored.restart_attempts,
                    ran_for=ran_for,
                    requested_stop=requested or stored.desired != "started",
                    backoff=self.backoff,
                )
                decision_box["decision"] = decision
                recorder.event(stored, "exit", reason=describe_exit(status), exit=info, kind="exit")
                if decision.restart:
                    stored.restart_attempts = decision.attempt
                    stored.machine.restarts += 1
                    stored.handle = None
                    recorder.event(stored, "starting", reason=decision.reason)
                    return tx.put_machine(stored, "restart")
                recorder.event(stored, decision.state, reason=decision.reason)
                stored.desired = decision.state
                stored.handle = None
                stored.machine.checks = {}
                return tx.put_machine(stored, "exit")

            stored = await recorder.commit(op)
            if stored is None:
                return  # a stale watcher: the checks running now belong to the next process
            self.stop_checks(machine_id)
            decision = decision_box["decision"]
            if decision.restart:
                metrics.RESTARTS.inc()
                timer = self.spawn(machine_id, self._restart_later(machine_id, decision.delay))
                self._restart_timers[machine_id] = timer
            elif stored.machine.config.auto_destroy:
                self.spawn(machine_id, self._auto_destroy(machine_id))

    async def _restart_later(self, machine_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        async with self.recorder.lock(machine_id):
            self._restart_timers.pop(machine_id, None)
            stored = self.store.get(machine_id)
            if stored is None or stored.machine.state != "starting" or stored.handle is not None:
                return
            await self.host.launch(stored)

    async def _auto_destroy(self, machine_id: str) -> None:
        with contextlib.suppress(Exception):
            await self.host.destroy(DestroyRequest(id=machine_id, force=True), source="worker")

    def cancel_restart(self, machine_id: str) -> None:
        """Call off a restart waiting out its back-off (the machine was stopped, updated or destroyed)."""
        timer = self._restart_timers.pop(machine_id, None)
        if timer is not None:
            timer.cancel()

    # ------------------------------------------------------------------------------------------
    # health checks

    def stop_checks(self, machine_id: str) -> None:
        current = asyncio.current_task()
        for task in list(self._tasks.get(machine_id, ())):
            if task is not current and task in self._checks:
                task.cancel()

    async def _check_loop(self, machine_id: str, handle: TaskHandle, name: str, check: Check) -> None:
        interval, timeout, grace = seconds(check.interval), seconds(check.timeout), seconds(check.grace_period)
        await asyncio.sleep(grace)
        last: str | None = None
        while True:
            stored = self.store.get(machine_id)
            if stored is None or stored.handle != handle or stored.machine.state != "started":
                return
            spec = self.host.task_spec(stored)
            result = await run_check(
                check.type,
                host=self.check_host,
                port=check.port or stored.machine.port,
                path=check.path,
                command=check.command,
                timeout=timeout,
                env=spec.env,
                cwd=spec.run_dir,
                run_as=spec.run_as,
            )
            metrics.CHECKS.labels(result.status).inc()
            if result.status != last:
                last = result.status
                await self._record_check(machine_id, handle, name, result.status, result.output)
            await asyncio.sleep(interval)

    async def _record_check(self, machine_id: str, handle: TaskHandle, name: str, status: str, output: str) -> None:
        recorder = self.recorder

        def op(tx: Tx) -> None:
            stored = tx.get(machine_id)
            if stored is None or stored.handle != handle or stored.machine.state != "started":
                return
            check = CheckStatus(name=name, status=status, output=output, updated_at=tx.now)  # type: ignore[arg-type]
            stored.machine.checks[name] = check
            recorder.event(
                stored,
                "check",
                reason=f"check {name} is {status}: {output}"[:300],
                kind="check",
                check=msgspec.structs.replace(check, output=output[:300]),
            )
            tx.put_machine(stored, "check")

        await recorder.commit(op)
