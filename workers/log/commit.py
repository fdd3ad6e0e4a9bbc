"""Group commit: one writer thread, many operations per LMDB transaction, one fsync per batch.

LMDB allows one writer at a time and an fsync costs about as much for one record as for hundreds,
so the worker funnels every write through one thread that takes whatever queued meanwhile and
commits it together. In a batch of several, each operation runs in its own nested transaction, so one
that raises is rolled back alone and its exception reaches only its caller; an operation alone in its
batch (every reserve at concurrency 1) runs in the batch's transaction itself, whose abort rolls back
the same writes, so a commit is one LMDB transaction, not two. Callers get their result only
after the batch's commit is durable: nothing acknowledged is lost to a crash. A caller cancelled while its
operation still queues (a restart's back-off cancelled by a destroy) withdraws it; once the writer has taken an
operation up it commits, whoever still waits for it.

Rows the audit stream has acknowledged (`Store.audits_delivered`) are deleted by whatever batch commits next, in
its transaction, never by a commit of their own: at concurrency 1 the next reserve would wait behind it. Only a
worker that has committed nothing for a while after such an ack commits them alone, when its agent says so
(`nudge`: no thread is woken per ack, and none wakes on a timer).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from bus.contract.errors import FauxmadError, InternalError
from workers import metrics
from workers.log.records import LogRecord, Usage
from workers.log.store import Store, Tx

T = TypeVar("T")

log = logging.getLogger(__name__)


class _Op:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[Tx], Any]) -> None:
        self.fn = fn
        self.future: Future[tuple[Any, list[LogRecord]]] = Future()


_STOP = object()
_NUDGE = object()  # acknowledged audit rows wait (`GroupCommitter.nudge`)


class GroupCommitter:
    """A writer thread that commits queued operations in batches: one fsync per batch.

    `submit(fn)` returns an awaitable of `(fn's result, the records it appended)`, resolved only
    after the batch's commit is durable. An operation that raises is rolled back alone (nested
    transaction) and its exception reaches its caller; the others in the batch commit.
    """

    def __init__(self, store: Store, *, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lmdb-writer", daemon=True)
        self.batches = 0
        self.ops = 0
        self._thread.start()

    async def submit(self, fn: Callable[[Tx], T]) -> tuple[T, list[LogRecord]]:
        op = _Op(fn)
        self._queue.put(op)
        result, records = await asyncio.wrap_future(op.future)
        return result, records

    def nudge(self) -> None:
        """(any thread) Delete the acked audit rows now, in a commit of their own if nothing else is queued."""
        self._queue.put(_NUDGE)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            try:
                if self._take_and_commit():
                    return
            except BaseException:  # never end the writer: every commit after it would wait forever
                log.exception("lmdb-writer: unexpected error (the writer goes on)")

    def _take_and_commit(self) -> bool:
        """Commit the next batch; True when asked to stop."""
        first = self._queue.get()
        if first is _NUDGE:
            if self.store.delivered_waiting:
                self._commit_delivered()
            return False
        if first is _STOP:
            if self.store.delivered_waiting:  # stopping: the next start need not send them again
                self._commit_delivered()
            return True
        batch = [first]
        stop = False
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _NUDGE:
                continue  # this batch's commit deletes the rows
            if item is _STOP:
                stop = True
                break
            batch.append(item)
        self._commit(batch)
        return stop

    def _commit(self, batch: list[_Op]) -> None:
        # an operation whose caller was cancelled while it queued (a restart's back-off that a destroy cancels)
        # is not run; the others are marked running, so no cancel can reach their futures any more: setting
        # the result of a cancelled future raises, and in this thread that ended the writer, and with it every
        # later commit of the worker (they waited forever)
        batch = [op for op in batch if op.future.set_running_or_notify_cancel()]
        if not batch:
            return
        store = self.store
        started = time.perf_counter()
        if len(batch) == 1:  # alone in its batch: one transaction, no nested one (the top of this module)
            self._commit_alone(batch[0], started)
            return
        outcomes: list[tuple[_Op, Any, list[LogRecord], BaseException | None]] = []
        usage = store.usage()  # the resources held, carried from one operation to the next (store.py's top)
        dropped: list[int] = []
        try:
            with store.rollback_seq(), store.env.begin(write=True) as txn:
                dropped = store.drop_delivered(txn)
                now = store.clock()
                for op in batch:
                    outcome, usage = self._run_one(txn, op, now, usage)
                    outcomes.append(outcome)
        except BaseException as exc:  # the commit itself failed: nothing in the batch happened
            store.undrop_delivered(dropped)
            failure = exc if isinstance(exc, FauxmadError) else InternalError(f"store commit failed: {exc!r}")
            for op in batch:
                op.future.set_exception(failure)
            return
        store.publish_usage(usage)  # durable now: readers and the next batch see it
        self._counted(len(batch), started)
        for op, result, records, error in outcomes:
            if error is not None:
                op.future.set_exception(error)
            else:
                op.future.set_result((result, records))

    def _commit_alone(self, op: _Op, started: float) -> None:
        """An operation with nothing else queued: it runs in the batch's one write transaction itself. If it
        raises, that transaction is aborted, which rolls back exactly what a nested one would have: its own
        writes, as nothing else is in it."""
        store = self.store
        ran = False
        dropped: list[int] = []
        try:
            with store.rollback_seq(), store.env.begin(write=True) as txn:
                dropped = store.drop_delivered(txn)
                tx = Tx(store, txn, store.clock(), store.usage())
                result = op.fn(tx)
                ran = True
        except BaseException as exc:  # the operation raised (rolled back), or the commit itself failed
            store.undrop_delivered(dropped)
            if ran and not isinstance(exc, FauxmadError):
                exc = InternalError(f"store commit failed: {exc!r}")
            op.future.set_exception(exc)
            return
        store.publish_usage(tx.held)  # durable now: readers and the next batch see it
        self._counted(1, started)
        op.future.set_result((result, tx.records))

    def _commit_delivered(self) -> None:
        """Nothing else committed for a while: delete the acknowledged audit rows in a commit of their own."""
        dropped: list[int] = []
        try:
            with self.store.env.begin(write=True) as txn:
                dropped = self.store.drop_delivered(txn)
        except BaseException:
            self.store.undrop_delivered(dropped)
            raise

    def _counted(self, ops: int, started: float) -> None:
        self.batches += 1
        self.ops += ops
        metrics.COMMITS.inc()
        metrics.COMMIT_BATCH.observe(ops)
        metrics.COMMIT_SECONDS.observe(time.perf_counter() - started)

    def _run_one(
        self, txn: Any, op: _Op, now: float, usage: Usage
    ) -> tuple[tuple[_Op, Any, list[LogRecord], BaseException | None], Usage]:
        """One operation in its nested transaction: its outcome, and the resources held after it (as before
        it if it failed: its changes are rolled back with its transaction)."""
        store = self.store
        child = store.env.begin(write=True, parent=txn)
        tx = Tx(store, child, now, usage)
        try:
            with store.rollback_seq():
                result = op.fn(tx)
        except BaseException as exc:
            child.abort()
            return (op, None, [], exc), usage
        child.commit()
        return (op, result, tx.records, None), tx.held
