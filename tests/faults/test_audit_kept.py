"""A create's audit record reaches the audit stream (kept 90 days) however a process dies: kill -9 of the worker
before the stream took it, and kill -9 of nats-server right after the creates' replies.

Why: the record rides in the reserve and the machine's `created` event (one durable write per create on the reply's
path), and the events stream keeps events 7 days; the worker sends the record to `FAUXMAD_AUDIT` after the reply,
keeping it in LMDB until the stream acks it (workers/audit_outbox.py). Here a real nats-server (fsync'd), a real
broker and a real worker: the worker's user may not publish audit records at first, so none can be acked; the
worker is killed with them pending, the server's users reloaded without the denial, the worker started again on
its data: every create's record is in the audit stream, once. Then creates under a server that is SIGKILLed right
after their replies and started again on its store: every record is there, once.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bus.contract import subjects
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.contract.streams import AuditRecord
from bus.local.embedded import EmbeddedNats
from bus.local.ports import free_port
from bus.transport.service import call
from lab.bench.worker import stop_process
from tests.helpers import (
    WorkerProcess,
    arun,
    audit_records,
    connect_nats,
    nats_config_denying,
    spawn_broker,
    until,
    wait_until,
)
from workers.log.store import Store

REGION = "mad"
CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=16))
WORKER = "audit-kept-w1"


@dataclass
class Fleet:
    server: EmbeddedNats
    config: Path
    store: Path
    worker: WorkerProcess
    fleet_url: str

    def allow_audit(self) -> None:
        """Reload the server's users without the worker's denial."""
        self.config.write_text(nats_config_denying(self.server.port, self.store, "worker", None))
        assert self.server.process is not None
        self.server.process.send_signal(signal.SIGHUP)


@contextmanager
def fleet(tmp_path: Path, deny_audit: bool) -> Iterator[Fleet]:
    port = free_port()
    store = tmp_path / "js"
    config = tmp_path / "nats.conf"
    config.write_text(nats_config_denying(port, store, "worker", subjects.AUDIT_ALL if deny_audit else None))
    server = EmbeddedNats(port=port, config_file=config, tls=False, store_dir=store).start()
    fleet_url = f"nats://fleet:fleet@127.0.0.1:{port}"
    worker = WorkerProcess(f"nats://worker:worker@127.0.0.1:{port}", REGION, WORKER, tmp_path / "worker", cpus=64)
    broker = spawn_broker(fleet_url, "audit-kept-b1", tmp_path / "broker.log")
    try:
        worker.start(timeout=40.0)
        yield Fleet(server, config, store, worker, fleet_url)
    finally:
        stop_process(broker)
        worker.cleanup()
        server.stop()


async def create(url: str, app: str, n: int) -> list[Machine]:
    """`n` creates through the broker, at once (each retried until the broker and its registry answer)."""
    nc = await connect_nats(url)
    try:

        async def one() -> Machine:
            request = CreateRequest(region=REGION, config=CONFIG, skip_launch=True)
            for _ in range(200):
                try:
                    return await call(nc, subjects.api_machines(app, "create"), request, Machine, timeout=10)
                except Exception:  # the broker not subscribed yet, or its registry not seeing the worker yet
                    await asyncio.sleep(0.1)
            raise AssertionError("no create placed in 20 s")

        return list(await asyncio.gather(*(one() for _ in range(n))))
    finally:
        await nc.close()


async def create_records(url: str, app: str) -> list[AuditRecord]:
    nc = await connect_nats(url)
    try:
        return [r for r in await audit_records(nc, app) if ".machines.create" in r.path]
    finally:
        await nc.close()


def wait_for_records(url: str, app: str, n: int) -> list[AuditRecord]:
    """Until the audit stream holds `n` create records of `app`; then read again: exactly `n` (no copy)."""

    async def enough() -> bool:
        return len(await create_records(url, app)) >= n

    arun(until(enough, f"{n} create audit records of {app} in the audit stream", 30.0, interval=0.2))
    found = arun(create_records(url, app))
    assert len(found) == n, [(r.request_id, r.at) for r in found]
    return found


def test_a_create_audit_record_pending_at_a_worker_kill_9_reaches_the_audit_stream_after_its_restart(
    tmp_path: Path,
) -> None:
    with fleet(tmp_path, deny_audit=True) as running:
        made = arun(create(running.fleet_url, "kept", 3))
        assert {m.worker_id for m in made} == {WORKER}
        log_path = running.worker.log_path
        wait_until(
            lambda: "the audit stream is not taking records" in log_path.read_text(),
            "the worker holding the records it may not deliver",
            20.0,
        )
        assert arun(create_records(running.fleet_url, "kept")) == []  # none delivered, none written by the broker
        running.worker.kill9()
        running.allow_audit()
        running.worker.start(timeout=40.0)
        found = wait_for_records(running.fleet_url, "kept", 3)
        assert {(r.identity, r.status, r.method, r.app) for r in found} == {("unsigned", 200, "NATS", "kept")}
        running.worker.terminate()  # acked: the rows are gone from its LMDB, so a next start sends nothing again
        assert Store(running.worker.data_dir / "lmdb").audits_to_deliver() == []


def test_create_audit_records_survive_a_nats_server_kill_9_right_after_the_replies(tmp_path: Path) -> None:
    with fleet(tmp_path, deny_audit=False) as running:
        arun(create(running.fleet_url, "warm", 1))  # the broker and the worker ready, the audit stream made
        made = arun(create(running.fleet_url, "crash", 24))
        running.server.kill()  # right after the replies: records in flight, or not sent yet
        running.server.start()
        found = wait_for_records(running.fleet_url, "crash", len(made))
        assert {r.path for r in found} == {subjects.api_machines("crash", "create")}
