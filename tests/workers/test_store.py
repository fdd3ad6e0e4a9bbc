"""The LMDB store: group commit, derived tables equal a replay of the log, compaction keeps that true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from bus.contract.errors import NoCapacity
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.contract.streams import AuditRecord
from tests.helpers import arun, until
from workers.log.commit import GroupCommitter
from workers.log.records import LogRecord, PendingAudit, StoredMachine, WorkerState
from workers.log.store import Store, Tx

T = TypeVar("T")


def machine(i: int, *, cpus: int = 1, state: str = "created") -> StoredMachine:
    return StoredMachine(
        machine=Machine(
            id=f"{i:014x}",
            name=f"m{i}",
            app="app",
            region="r",
            worker_id="w",
            state=state,  # type: ignore[arg-type]
            config=MachineConfig(cmd=["true"], guest=Guest(cpus=cpus, memory_mb=64)),
            instance_id="i",
            created_at="t",
            updated_at="t",
        ),
        idempotency_key=f"key-{i}",
    )


def test_group_commit_batches_and_every_result_is_durable(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    committer = GroupCommitter(store)

    async def main() -> None:
        await asyncio.gather(
            *[committer.submit(lambda tx, i=i: tx.put_machine(machine(i), "reserve")) for i in range(2000)]
        )

    arun(main())
    assert committer.batches < 2000  # batched: fewer fsyncs than operations
    committer.close()
    store.close()
    reopened = Store(tmp_path / "db")
    assert len(reopened.machines()) == 2000
    assert reopened.usage().cpus == 2000
    assert reopened.last_seq == 2000


def test_every_commit_is_fsynced_by_default_from_the_cli_to_lmdb(tmp_path: Path) -> None:
    """The durability promise ("a worker answers only after its commit reached the disk") rests on three
    defaults: LMDB opened with sync and metasync (a commit returns after its fsync), the worker's config,
    and `fauxmad worker` without `--no-fsync`. A reopen after a clean close (above) or a kill -9 of the writer
    cannot tell (the page cache survives both; only a power loss shows it), so this reads the flags LMDB
    itself reports: each default turned off fails here."""
    import inspect

    from orchestrator.cli.worker_cmd import worker
    from orchestrator.devfleet import FleetSpec
    from workers.agent.config import WorkerConfig

    store = Store(tmp_path / "db")
    flags = store.env.flags()
    store.close()
    assert flags["sync"] is True and flags["metasync"] is True, flags
    assert flags["map_async"] is False and flags["writemap"] is False, flags  # no writes behind the fsync's back
    config = WorkerConfig(nats_url="nats://x", region="r", worker_id="w", cpus=1, memory_mb=64, data_dir="d")
    assert config.fsync is True
    assert inspect.signature(worker).parameters["no_fsync"].default.default is False
    assert FleetSpec().fsync is True  # the dev fleets the tests and `fauxmad dev` run


def test_a_failing_operation_rolls_back_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    committer = GroupCommitter(store)

    def reserve_within(limit: int, i: int):  # type: ignore[no-untyped-def]
        def op(tx: Tx) -> StoredMachine:
            if tx.usage().cpus + 1 > limit:
                tx.put_machine(machine(i), "reserve")  # written, then rolled back with the error
                raise NoCapacity("full")
            return tx.put_machine(machine(i), "reserve")

        return op

    async def main() -> list[object]:
        return await asyncio.gather(
            *[committer.submit(reserve_within(5, i)) for i in range(20)], return_exceptions=True
        )

    results = arun(main())
    assert sum(not isinstance(r, Exception) for r in results) == 5
    assert store.usage().cpus == 5 and len(store.machines()) == 5
    assert store.log_length() == 5 and store.last_seq == 5
    committer.close()


def test_an_operation_alone_in_its_batch_is_one_transaction_and_rolls_back_alone(tmp_path: Path) -> None:
    """A commit with one operation (every reserve at concurrency 1) begins one LMDB write transaction, not a
    batch's and a nested one inside it; when that operation writes and then raises, aborting the one transaction
    takes back its writes and its sequence numbers, and the next operation commits as usual. Fails if the nested
    transaction comes back for a batch of one (two begins)."""
    store = Store(tmp_path / "db", sync=False)
    real = store.env
    begins: list[dict[str, object]] = []

    class Counting:  # the real environment, its write transactions counted
        def begin(self, **kwargs: Any) -> Any:
            if kwargs.get("write"):
                begins.append(kwargs)
            return real.begin(**kwargs)

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

    store.env = Counting()  # type: ignore[assignment]
    committer = GroupCommitter(store)

    def written_then_refused(tx: Tx) -> None:
        tx.put_machine(machine(2), "reserve")
        raise NoCapacity("full")

    async def one(fn: Callable[[Tx], T]) -> tuple[T, list[LogRecord]]:
        return await committer.submit(fn)

    stored, records = arun(one(lambda tx: tx.put_machine(machine(1), "reserve")))
    assert len(begins) == 1 and "parent" not in begins[0], begins
    assert [record.seq for record in records] == [1] and stored.machine.version == 1
    with pytest.raises(NoCapacity, match="full"):
        arun(one(written_then_refused))
    assert store.get(machine(2).machine.id) is None and store.last_seq == 1 and store.log_length() == 1
    assert store.usage().cpus == 1
    stored, _ = arun(one(lambda tx: tx.put_machine(machine(3), "reserve")))
    assert stored.machine.version == 2 and store.usage().cpus == 2
    assert all("parent" not in kwargs for kwargs in begins) and len(begins) == 3
    committer.close()
    store.close()


def test_rebuild_from_log_equals_live_tables_and_survives_compaction(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    for i in range(50):
        store.write(lambda tx, i=i: tx.put_machine(machine(i, cpus=1 + i % 3), "reserve"))
    for i in range(0, 50, 2):

        def advance(tx: Tx, i: int = i) -> None:
            stored = tx.require(f"{i:014x}")
            for state in ("starting", "started", "stopping", "stopped"):
                stored.machine.state = state  # type: ignore[assignment]
                tx.put_machine(stored, state)

        store.write(advance)
    for i in range(0, 50, 5):

        def destroy(tx: Tx, i: int = i) -> None:
            stored = tx.require(f"{i:014x}")
            stored.machine.state = "destroyed"
            tx.put_machine(stored, "destroyed")

        store.write(destroy)
    store.write(lambda tx: tx.put_worker(WorkerState(cordoned=True, reason="maintenance"), "cordon"))
    store.write(lambda tx: tx.touch_image("registry/app:1"))
    live = store.snapshot()
    assert store.rebuild() == live
    assert live.usage.machines == 40 and live.worker.cordoned

    before = store.log_length()
    deleted = store.compact(keep_last=0, destroyed_retention=3600)
    assert deleted > 0 and store.log_length() == before - deleted
    assert store.rebuild() == store.snapshot() == live  # replay is exact after compaction

    # destroyed machines past retention leave the table and the log together
    store.clock = lambda: 10**12
    store.compact(keep_last=0, destroyed_retention=1)
    after = store.snapshot()
    assert len(after.machines) == 40 and store.rebuild() == after


def test_reopen_continues_the_sequence(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.write(lambda tx: tx.put_machine(machine(1), "reserve"))
    store.close()
    store = Store(tmp_path / "db")
    stored = store.write(lambda tx: tx.put_machine(machine(2), "reserve"))
    assert stored.machine.version == 2


@pytest.mark.parametrize("n", [1, 7])
def test_usage_follows_resource_holding_states(tmp_path: Path, n: int) -> None:
    store = Store(tmp_path / "db")
    for i in range(n):
        store.write(lambda tx, i=i: tx.put_machine(machine(i, cpus=2), "reserve"))
    assert store.usage().cpus == 2 * n

    def destroy_first(tx: Tx) -> None:
        stored = tx.require(f"{0:014x}")
        stored.machine.state = "destroyed"
        tx.put_machine(stored, "destroyed")

    store.write(destroy_first)
    assert store.usage().cpus == 2 * (n - 1) and store.usage().machines == n - 1


def test_a_caller_cancelled_while_its_commit_waits_leaves_the_writer_alive(tmp_path: Path) -> None:
    """A task cancelled while it awaits a commit (a restart's back-off cancelled by a destroy) cancels the
    commit's future; the writer thread must live on: setting a cancelled future's result raised in it, the
    thread died, and every later commit of that worker waited forever."""
    import threading

    store = Store(tmp_path / "db")
    committer = GroupCommitter(store)
    gate = threading.Event()
    inside = threading.Event()

    def slow(tx: Tx) -> StoredMachine:
        inside.set()
        gate.wait(5)  # holds the writer: the next operation queues behind it
        return tx.put_machine(machine(0), "reserve")

    async def main() -> StoredMachine:
        first = asyncio.ensure_future(committer.submit(slow))
        await until(lambda: asyncio.sleep(0, inside.is_set()), "the writer taking up the first operation, alone")
        queued = asyncio.ensure_future(committer.submit(lambda tx: tx.put_machine(machine(1), "reserve")))
        await until(lambda: asyncio.sleep(0, committer._queue.qsize() == 1), "the second operation queued")
        queued.cancel()  # cancelled before the writer takes it up
        # done once the cancel reached the commit's future too (wrap_future's callback runs before the task's)
        await until(lambda: asyncio.sleep(0, queued.done()), "the queued operation's caller cancelled")
        gate.set()
        await first
        result, _ = await asyncio.wait_for(committer.submit(lambda tx: tx.put_machine(machine(2), "reserve")), 5)
        return result

    try:
        assert arun(main()).machine.id == machine(2).machine.id
        assert committer._thread.is_alive()
        stored = {m.machine.id for m in store.machines()}
        assert machine(1).machine.id not in stored  # cancelled before the writer took it up: not run
        assert {machine(0).machine.id, machine(2).machine.id} <= stored
    finally:
        gate.set()
        committer.close()


def test_audit_rows_acked_go_with_the_next_commit_or_alone_when_nudged_and_stay_until_then(tmp_path: Path) -> None:
    """A create's audit record is kept (table `audit`) in its reserve's commit; once the audit stream acks it, its
    row is deleted by the next commit, not by one of its own (a reserve would wait behind it), unless the worker's
    agent nudges the writer (it committed nothing for a while), or the writer stops. An operation that fails puts
    the acked rows back for the next."""
    store = Store(tmp_path / "db", sync=False)
    committer = GroupCommitter(store)
    record = AuditRecord(at=1.0, identity="nkey:UA", name="ci", method="NATS", path="fauxmad.v1.api.x", status=200)

    def reserve(i: int) -> Callable[[Tx], None]:
        def op(tx: Tx) -> None:
            made = tx.put_machine(machine(i), "reserve").machine
            tx.keep_audit(PendingAudit(seq=made.version, app=made.app, machine_id=made.id, record=record))

        return op

    def refused(tx: Tx) -> None:
        raise NoCapacity("full")

    arun(committer.submit(reserve(1)))
    arun(committer.submit(reserve(2)))
    assert [(p.seq, p.record) for p in store.audits_to_deliver()] == [(1, record), (2, record)]
    store.audits_delivered([1])
    assert [p.seq for p in store.audits_to_deliver()] == [1, 2]  # no commit of its own
    with pytest.raises(NoCapacity):
        arun(committer.submit(refused))
    assert [p.seq for p in store.audits_to_deliver()] == [1, 2]  # that commit was rolled back, the row kept
    arun(committer.submit(reserve(3)))
    assert [p.seq for p in store.audits_to_deliver()] == [2, 3]  # gone with the next commit
    committer.close()

    idle = GroupCommitter(store)
    store.audits_delivered([2])
    idle.nudge()
    arun(until(lambda: _rows_left(store, [3]), "the acked row deleted by the nudged writer"))
    store.audits_delivered([3])
    idle.close()  # a stopping writer deletes what waits
    store.close()
    assert Store(tmp_path / "db").audits_to_deliver() == []


async def _rows_left(store: Store, seqs: list[int]) -> bool:
    return [p.seq for p in store.audits_to_deliver()] == seqs
