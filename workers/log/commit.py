"""Group commit: the operations of one event-loop turn in one LMDB transaction, with one fsync.

LMDB allows one writer at a time and an fsync costs about as much for one record as for hundreds, so every
write of the worker is an operation submitted here, and the operations submitted during one turn of the event
loop (the reserves of one read from the socket, say) are committed together at the end of that turn, on the
loop itself: no thread to wake and no thread to wake the loop back (py-spy and the worker's commit metrics, at
concurrency 1: those two hand-offs were a fifth of a reserve's time outside its fsync). Each operation still
runs in its own nested transaction, so one that raises is rolled back alone and its exception reaches only its
caller. Callers get their result only after the batch's commit is durable: nothing acknowledged is lost to a
crash.

The loop never waits for LMDB's write lock: while another thread writes (compaction, `Store.compacting`), or
batches handed to it are still in flight, batches go to a writer thread instead, which takes the lock off the
loop and hands the results back to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from bus.contract.errors import FauxmadError, InternalError
from workers import metrics
from workers.log.records import LogRecord
from workers.log.store import Store, Tx

T = TypeVar("T")


class _Op:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[Tx], Any], future: asyncio.Future[tuple[Any, list[LogRecord]]]) -> None:
        self.fn = fn
        self.future = future


Outcome = tuple[_Op, Any, list[LogRecord], BaseException | None]

_STOP = object()


class GroupCommitter:
    """`submit(fn)` returns an awaitable of `(fn's result, the records it appended)`, resolved only after the
    batch's commit is durable. An operation that raises is rolled back alone (nested transaction) and its
    exception reaches its caller; the others in the batch commit."""

    def __init__(self, store: Store, *, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._turn: list[_Op] = []  # submitted during this loop turn: committed at its end
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started the first time the loop must not take the lock
        self._handed = 0  # batches handed to the writer thread and not settled yet
        self.batches = 0
        self.ops = 0

    async def submit(self, fn: Callable[[Tx], T]) -> tuple[T, list[LogRecord]]:
        loop = asyncio.get_running_loop()
        op = _Op(fn, loop.create_future())
        self._turn.append(op)
        if len(self._turn) == 1:
            loop.call_soon(self._end_of_turn, loop)
        result, records = await op.future
        return result, records

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------
    def _end_of_turn(self, loop: asyncio.AbstractEventLoop) -> None:
        turn, self._turn = self._turn, []
        for start in range(0, len(turn), self.max_batch):
            batch = turn[start : start + self.max_batch]
            if self._handed or self.store.compacting:  # the lock is (or may be) taken: wait for it off the loop
                self._hand_over(batch, loop)
            else:
                _settle(self._commit(batch))

    def _hand_over(self, batch: list[_Op], loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lmdb-writer", daemon=True)
            self._thread.start()
        self._handed += 1
        self._queue.put((batch, loop))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch, loop = item
            outcomes = self._commit(batch)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(self._settle_handed, outcomes)

    def _settle_handed(self, outcomes: list[Outcome]) -> None:
        self._handed -= 1
        _settle(outcomes)

    def _commit(self, batch: list[_Op]) -> list[Outcome]:
        store = self.store
        outcomes: list[Outcome] = []
        started = time.perf_counter()
        try:
            with store.rollback_seq(), store.env.begin(write=True) as txn:
                now = store.clock()
                for op in batch:
                    outcomes.append(self._run_one(txn, op, now))
        except BaseException as exc:  # the commit itself failed: nothing in the batch happened
            failure = exc if isinstance(exc, FauxmadError) else InternalError(f"store commit failed: {exc!r}")
            return [(op, None, [], failure) for op in batch]
        self.batches += 1
        self.ops += len(batch)
        metrics.COMMITS.inc()
        metrics.COMMIT_BATCH.observe(len(batch))
        metrics.COMMIT_SECONDS.observe(time.perf_counter() - started)
        return outcomes

    def _run_one(self, txn: Any, op: _Op, now: float) -> Outcome:
        store = self.store
        child = store.env.begin(write=True, parent=txn)
        tx = Tx(store, child, now)
        try:
            with store.rollback_seq():
                result = op.fn(tx)
        except BaseException as exc:
            child.abort()
            return op, None, [], exc
        child.commit()
        return op, result, tx.records, None


def _settle(outcomes: list[Outcome]) -> None:
    """Each caller's result or exception, on the loop (a caller that gave up, cancelled, is skipped)."""
    for op, result, records, error in outcomes:
        if op.future.done():
            continue
        if error is not None:
            op.future.set_exception(error)
        else:
            op.future.set_result((result, records))
