"""A fail-back keeps exactly one running copy of the instance: the two machines never stop each other.

Found by a random fault run. Failover labels the successor `fauxmad_replaces=<predecessor>`; when the
predecessor's host came back it was stopped and kept as the successor's spare, but the successor kept its label.
When the successor's host was lost in turn, that spare took over (`fauxmad_replaces=<successor>`), and when the
host came back the two named each other: the operator stopped both ("stop A: replaced by B" next to "stop B:
replaced by A") and the region was short until a new machine started.

Real parts: a dev fleet (nats-server, two workers, a broker), an app with one primary and one spare deployed
with `fauxmad deploy`, and `fauxmad reconcile --watch` as a subprocess. The primary's worker is frozen
(SIGSTOP) until its spare takes over, then continued; once the old primary is the new one's spare, the new
primary's worker is frozen and continued the same way: the instance fails back. Then the two copies are watched
on their workers until the instance settles: one runs, the other is its spare, and no stretch with no copy
running is longer than a short window.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Awaitable
from pathlib import Path

from nats.aio.client import Client

from bus.contract import subjects
from bus.contract.machines import ListRequest, Machine
from bus.transport.connection import connect
from bus.transport.service import call
from orchestrator.apps.ownership import RUNNING
from orchestrator.apps.spec import REPLACES_KEY
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.reconcile.observe import health
from tests.helpers import arun, fleet_fixture, start_operator, until, wait_until
from tests.orchestrator.reconcile.test_reconcile import fauxmad, machines, primaries, role, spares, write_spec

REGION = "fbk"
APP = "failback"
SHORT_WINDOW = 2.0  # seconds with no copy running that a fail-back may cost at most (it should cost none)
STOPPED_BY = re.compile(r" stop (\S+): replaced by (\S+)")


fleet = fleet_fixture(
    FleetSpec(regions=[REGION], workers_per_region=2, cpus=4, memory_mb=2048, brokers=1), scope="function"
)


class Copies:
    """The instance's machines as their workers report them (one list each, asked directly)."""

    def __init__(self, fleet: DevFleet, nc: Client) -> None:
        self.fleet = fleet
        self.nc = nc

    async def on(self, worker_id: str) -> list[Machine] | None:
        try:
            ask = ListRequest(app=APP)
            found = await call(self.nc, subjects.worker_machines(worker_id, "list"), ask, list[Machine], timeout=1.0)
        except Exception:
            return None  # frozen, or not back yet
        return [m for m in found if m.state not in ("destroying", "destroyed")]

    async def everywhere(self) -> list[Machine] | None:
        """Every machine of the app, or None unless every worker answered."""
        lists = await asyncio.gather(*(self.on(w) for w in self.fleet.worker_ids))
        if any(found is None for found in lists):
            return None
        return [m for found in lists if found is not None for m in found]


def worker_pid(fleet: DevFleet, worker_id: str) -> int:
    return next(p.pid for name, p in fleet.processes if name == f"worker-{worker_id}")


async def fail_over(fleet: DevFleet, copies: Copies, primary: Machine, spare: Machine, log: Path) -> None:
    """Freeze `primary`'s worker until `spare` runs, healthy, as the primary in its place; then continue it."""

    async def took_over() -> bool:
        found = await copies.on(spare.worker_id)
        return any(m.id == spare.id and role(m) == "primary" and health(m)[0] for m in found or [])

    pid = worker_pid(fleet, primary.worker_id)
    os.kill(pid, signal.SIGSTOP)
    try:
        await with_log(until(took_over, f"{spare.id} taking over from {primary.id}", 30, interval=0.1), log)
    finally:
        os.kill(pid, signal.SIGCONT)


async def kept_as_spare(copies: Copies, machine: Machine, of: Machine, log: Path) -> None:
    async def demoted() -> bool:
        found = await copies.on(machine.worker_id)
        return any(m.id == machine.id and role(m) == "spare" and m.config.standbys == [of.id] for m in found or [])

    await with_log(until(demoted, f"{machine.id} kept as the spare of {of.id}", 30, interval=0.1), log)


async def with_log(waiting: Awaitable[object], log: Path) -> None:
    """`waiting`, with the operator's log in its failure: what it did instead."""
    try:
        await waiting
    except AssertionError as exc:
        raise AssertionError(f"{exc}; operator log:\n{log.read_text()[-3000:]}") from None


def test_a_fail_back_keeps_exactly_one_running_copy(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "fauxmad.toml", APP, regions=f"{REGION} = 1", spares=1)
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    wait_until(lambda: len(spares(machines(fleet, APP))) == 1, "the spare", 20)
    found = machines(fleet, APP)
    first, second = primaries(found)[0], spares(found)[0]
    assert first.worker_id != second.worker_id
    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, APP)
    zero_stretches: list[float] = []
    fail_back_from = [0]
    settled: list[Machine] = []

    async def scenario() -> None:
        nc = await connect(fleet.url, "test-failback")
        copies = Copies(fleet, nc)
        try:
            await fail_over(fleet, copies, first, second, log)  # the first host is lost: `second` takes over
            await kept_as_spare(copies, first, second, log)  # it comes back: `first` is the spare of `second`
            fail_back_from[:] = [len(log.read_text())]  # what the operator logs from here on is the fail-back's
            await fail_over(fleet, copies, second, first, log)  # then the second host: `first` takes it back
            zero_since: float | None = None

            async def one_copy_left() -> bool:
                nonlocal zero_since
                now = await copies.everywhere()
                if now is None:
                    return False  # a worker not answering says nothing about the copies
                running = [m for m in now if m.state in RUNNING]
                if running:
                    if zero_since is not None:
                        zero_stretches.append(time.monotonic() - zero_since)
                        zero_since = None
                elif zero_since is None:
                    zero_since = time.monotonic()
                resting = [m for m in now if m.state not in RUNNING]
                # settled: one copy runs, as the primary, its takeover over (no claim left), and the other is its spare
                one = len(running) == 1 and role(running[0]) == "primary"
                over = one and REPLACES_KEY not in running[0].config.metadata
                if over and resting and all(role(m) == "spare" for m in resting):
                    settled[:] = running
                    return True
                return False

            settling = until(one_copy_left, "the instance settling on one running copy and its spare", 45, interval=0.1)
            await with_log(settling, log)
            if zero_since is not None:
                zero_stretches.append(time.monotonic() - zero_since)
        finally:
            await nc.close()

    try:
        arun(scenario())
    finally:
        operator.send_signal(signal.SIGINT)
        code = operator.wait(20)
    text = log.read_text()
    stops = set(STOPPED_BY.findall(text[fail_back_from[0] :]))  # (the first failover stopped `first` for `second`)
    both = [(a, b) for a, b in stops if (b, a) in stops]
    assert not both, f"both copies stopped, each as replaced by the other: {both}\n{text[-3000:]}"
    short = [line for line in text.splitlines() if f"{REGION} has 0 of 1 machines" in line]
    assert not short, f"a pass found no primary for the instance: {short}\n{text[-3000:]}"
    assert len(settled) == 1
    assert max(zero_stretches, default=0.0) <= SHORT_WINDOW, (zero_stretches, text[-3000:])
    assert code == 0, text[-3000:]
    fauxmad(fleet, "apps", "destroy", APP, "--yes")
