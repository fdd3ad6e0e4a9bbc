"""Re-adopting machines after the worker restarts: finish every transition that was in flight.

A worker may die at any point of any verb; its machines' processes outlive it (the shim holds
them). At start-up each machine in a process state is settled by what the store says it was doing
and whether its process still runs: a destroy or an update cut short is finished, a running process
is watched again, and one that ended while the worker was down gets its exit handled like any other.
A start cut short between spawning the process and recording it is started again only once the process
it spawned (found by the machine id in its environment) is gone: one run of a machine at a time.
It asks the machine manager (`Host`) only for its parts, to launch a process, to finish a destroy or a
suspend (`pauses`), and to record a resume it answered but did not record.
"""

from __future__ import annotations

import logging
import signal as signals
from collections import defaultdict
from typing import Literal, Protocol

from workers.driver.base import Driver, TaskHandle, TaskState
from workers.lifecycle.pause import Pauses
from workers.lifecycle.recorder import Recorder
from workers.lifecycle.signals import parse_signal
from workers.lifecycle.supervisor import Supervisor
from workers.log.machine_states import PROCESS_STATES
from workers.log.records import StoredMachine
from workers.log.store import Store, Tx

log = logging.getLogger(__name__)


class Host(Protocol):
    """What resuming asks of the machine manager: its parts, a launch and the end of a destroy."""

    store: Store
    driver: Driver
    recorder: Recorder
    supervisor: Supervisor

    async def launch(self, stored: StoredMachine) -> StoredMachine: ...

    @property
    def pauses(self) -> Pauses: ...

    async def finish_destroy(self, stored: StoredMachine) -> StoredMachine: ...


async def resume_in_flight(host: Host, *, stop_timeout: float) -> dict[str, int]:
    """Finish every transition in flight when the worker stopped; returns counts per outcome."""
    outcomes: dict[str, int] = defaultdict(int)
    for stored in host.store.machines():
        if stored.machine.state not in PROCESS_STATES:
            continue
        try:
            outcome = await _resume_one(host, stored, stop_timeout)
        except Exception:
            log.exception("machine %s: could not resume", stored.machine.id)
            outcome = "error"
        outcomes[outcome] += 1
    return dict(outcomes)


async def _resume_one(host: Host, stored: StoredMachine, stop_timeout: float) -> str:
    machine_id = stored.machine.id
    state = stored.machine.state
    handle = stored.handle
    driver, recorder, supervisor = host.driver, host.recorder, host.supervisor
    alive = handle is not None and driver.recover(handle)
    if state == "destroying":
        async with recorder.lock(machine_id):
            await host.finish_destroy(stored)
        return "destroyed"
    if state == "replacing":  # an update was cut short: restart on the config it still has
        async with recorder.lock(machine_id):
            if handle is not None and alive:
                await driver.stop(handle, stop_timeout, signals.SIGTERM)

            await _end_strays(driver, machine_id)  # the new process, if it was spawned before the kill

            def restart(tx: Tx) -> StoredMachine:
                current = tx.require(machine_id)
                current.handle = None
                recorder.event(current, "starting", reason="worker restarted during an update")
                return tx.put_machine(current, "resume")

            await host.launch(await recorder.commit(restart))
        return "relaunched"
    if handle is None:
        if state == "starting":
            async with recorder.lock(machine_id):
                await _end_strays(driver, machine_id)  # spawned before the kill, never recorded: one run only
                await host.launch(stored)
            return "launched"
        return await _settle_without_process(recorder, stored)
    if alive:
        supervisor.supervise(stored)  # re-adopted: its exit will arrive through the watcher
        if state == "stopping":
            signum = parse_signal(stored.stop_signal)
            supervisor.spawn(machine_id, driver.stop(handle, stop_timeout, signum))
        elif state == "suspending":  # frozen or not when we died: freeze it and record it
            async with recorder.lock(machine_id):
                await host.pauses.freeze(stored)
        elif state == "suspended":
            return await _readopt_suspended(host, stored, handle)
        return "adopted"
    status = await driver.wait(handle)  # ended while we were down: the shim left its status
    await supervisor.on_exit(machine_id, handle, status)
    return "exited"


async def _end_strays(driver: Driver, machine_id: str) -> None:
    ended = await driver.end_strays(machine_id)
    if ended:
        log.warning("machine %s: ended %d process(es) of a start the worker never recorded", machine_id, ended)


async def _readopt_suspended(host: Host, stored: StoredMachine, handle: TaskHandle) -> str:
    found = suspended_found(host.driver.inspect(handle))
    if found == "resumed":  # a resume answered before its record: the process's word wins
        return await _record_resumed(host, stored)
    if found == "frozen":  # stopped already; again, in case a thread was not yet
        await host.driver.signal(handle, signals.SIGSTOP)
    # "ended": it died since `recover`; its exit arrives through the watcher, from `suspended`
    return "adopted"


def suspended_found(task: TaskState) -> Literal["resumed", "frozen", "ended"]:
    """What a machine recorded `suspended` turns out to be on a worker's start: its process continued (a
    resume answered, not recorded), still frozen, or ended meanwhile. An ended one is not recorded
    `started` first: whether it ran again before it ended cannot be told, and its exit is the fact."""
    if not task.running:
        return "ended"
    return "frozen" if task.stopped else "resumed"


async def _record_resumed(host: Host, stored: StoredMachine) -> str:
    """A machine recorded `suspended` whose process runs: a resume continued it (and answered) before the
    worker died, so it is `started`, as its caller was told (workers/lifecycle/pause.py `resume`)."""
    async with host.recorder.lock(stored.machine.id):
        await host.pauses.record_resumed(stored.machine.id, "resumed (SIGCONT) before the worker restarted")
    return "resumed"


async def _settle_without_process(recorder: Recorder, stored: StoredMachine) -> str:
    machine_id = stored.machine.id

    def op(tx: Tx) -> StoredMachine:
        current = tx.require(machine_id)
        target = "stopped" if current.machine.state == "stopping" else "failed"
        recorder.event(current, target, reason="worker restarted; no process found")
        return tx.put_machine(current, "resume")

    async with recorder.lock(machine_id):
        await recorder.commit(op)
    return "settled"
