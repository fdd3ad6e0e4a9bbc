"""Suspend and resume: freeze a started machine's process group and continue it (an edge proxy's
`auto_stop = "suspend"`).

A suspended machine keeps its memory, its port and its reservation, and comes back in about a millisecond
plus one commit, where a start would run the program again. Its own module because a resume answers
before its record is made (the record would cost the request the machine was resumed for its cores): the
resumes answered and not yet recorded live here, and reads ask `resuming` to show those machines `started`,
as the answer did. A worker restart finishes either half (`freeze`, `record_resumed`: workers/lifecycle/resume.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal as signals
from collections.abc import Callable
from typing import Protocol

import msgspec

from bus.contract.errors import Conflict
from bus.contract.machines import Machine, ResumeRequest, SuspendRequest
from workers.driver.base import Driver
from workers.lifecycle import leases
from workers.lifecycle.recorder import Recorder
from workers.lifecycle.supervisor import Supervisor
from workers.log.records import StoredMachine
from workers.log.store import Tx

log = logging.getLogger(__name__)

# seconds between a resume's answer and its record: the request the machine was resumed for is answered 1 to
# 3 ms after the signal (recorded at once, the commit and its event competed with it: the first byte through
# the proxy had p50s of 2.7-3.4 ms in `fauxmad bench proxy`, 2.3-3.1 ms with this delay)
RESUME_RECORD_DELAY = 0.005


class Host(Protocol):
    """What suspending and resuming ask of the machine manager: its parts, a machine's lock, reads."""

    recorder: Recorder
    driver: Driver
    supervisor: Supervisor
    clock: Callable[[], float]

    def lock(self, machine_id: str) -> asyncio.Lock: ...

    def require(self, machine_id: str) -> StoredMachine: ...

    def view(self, stored: StoredMachine, *, events: bool = False) -> Machine: ...


class Pauses:
    def __init__(self, host: Host) -> None:
        self.host = host
        # resumes answered, their records being made: reads show these machines `started` already, as the
        # resume's answer did (read your writes), and the task is kept from the garbage collector
        self._resuming: dict[str, asyncio.Task[None]] = {}

    def resuming(self, machine_id: str) -> bool:
        return machine_id in self._resuming

    async def suspend(self, request: SuspendRequest) -> Machine:
        host = self.host
        async with host.lock(request.id):

            def mark(tx: Tx) -> StoredMachine:
                stored = tx.require(request.id)
                leases.check(stored, request.lease_nonce, tx.now)
                if stored.machine.state in ("suspending", "suspended"):
                    return stored
                if stored.machine.state != "started" or stored.handle is None:
                    raise Conflict(f"machine {request.id} is {stored.machine.state}; only a started machine suspends")
                host.recorder.event(stored, "suspending", source="user", reason="suspend requested")
                return tx.put_machine(stored, "suspend")

            stored = await host.recorder.commit(mark)
            if stored.machine.state == "suspended":
                return host.view(stored)
            return host.view(await self.freeze(stored))

    async def freeze(self, stored: StoredMachine) -> StoredMachine:
        """SIGSTOP the process group, then record `suspended` (also how a worker restart finishes one)."""
        assert stored.handle is not None
        host = self.host
        host.supervisor.stop_checks(stored.machine.id)
        await host.driver.signal(stored.handle, signals.SIGSTOP)

        def frozen(tx: Tx) -> StoredMachine:
            current = tx.require(stored.machine.id)
            if current.machine.state == "suspending":
                host.recorder.event(current, "suspended", reason="process group stopped (SIGSTOP)")
                return tx.put_machine(current, "suspended")
            return current  # it exited meanwhile: the supervisor has recorded that

        return await host.recorder.commit(frozen)

    async def resume(self, request: ResumeRequest) -> Machine:
        """SIGCONT, answer `started`, then record it. The answer does not wait for the record (an fsync'd
        commit, most of a resume's time: an edge proxy holds a request on it): the kernel already holds the
        fact, and a worker that dies before the record finds a `suspended` machine whose process runs and
        records it `started` (workers/lifecycle/resume.py: for a suspended machine the process's word wins). The
        record is made `RESUME_RECORD_DELAY` later, once the machine has answered the request it was
        resumed for: its commit and the event it publishes would take the cores the machine, NATS and the
        proxy need right then. The machine's lock is held until the record is made, so whatever comes next
        sees `started`."""
        host = self.host
        lock = host.lock(request.id)
        await lock.acquire()
        handed_over = False  # to the task that records the resume, which releases the lock when done
        try:
            stored = host.require(request.id)
            leases.check(stored, request.lease_nonce, host.clock())
            if stored.machine.state == "started":
                return host.view(stored)
            if stored.machine.state not in ("suspended", "suspending") or stored.handle is None:
                raise Conflict(f"machine {request.id} is {stored.machine.state}; only a suspended machine resumes")
            await host.driver.signal(stored.handle, signals.SIGCONT)
            answer = msgspec.structs.replace(host.view(stored), state="started")
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
        host = self.host

        def thawed(tx: Tx) -> StoredMachine:
            current = tx.require(machine_id)
            if current.machine.state in ("suspended", "suspending"):
                host.recorder.event(current, "started", source="user", reason=reason)
                return tx.put_machine(current, "resume")
            return current

        stored = await host.recorder.commit(thawed)
        if stored.machine.state == "started":
            host.supervisor.start_checks(stored)
        return stored

    async def close(self) -> None:
        """Make the records of resumes already answered (`RESUME_RECORD_DELAY` away)."""
        if self._resuming:
            await asyncio.gather(*self._resuming.values(), return_exceptions=True)
