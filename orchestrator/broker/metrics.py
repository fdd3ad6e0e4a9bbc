"""The broker's Prometheus metrics (`fauxmad broker --metrics-listen HOST:PORT`): auctions by strategy and
outcome, how long a create takes here (auction, reserve and, for a hedge, the start), and the size of each
gather (workers asked and answered, creates sharing one scatter), which is what a region's growth moves."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from prometheus_client import Counter, Histogram

from bus.contract.errors import FauxmadError
from orchestrator.broker.auction import Outcome

T = TypeVar("T")
FAST = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
SIZES = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

CREATES = Counter("fauxmad_broker_creates_total", "creates answered", ["strategy", "outcome"])
CREATE_SECONDS = Histogram("fauxmad_broker_create_seconds", "create latency at the broker", ["strategy"], buckets=FAST)
ASKED = Histogram("fauxmad_broker_gather_asked", "workers asked per auction", buckets=SIZES)
ANSWERED = Histogram("fauxmad_broker_gather_answered", "workers that answered per auction", buckets=SIZES)
SHARED = Histogram("fauxmad_broker_scatter_shared", "creates one scatter answered", buckets=SIZES)


@functools.cache
def _placed(strategy: str) -> tuple[Any, Any]:
    """A placed create's counter and latency histogram for `strategy`, looked up once (prometheus_client's
    `labels` takes a lock and builds a key on every call: issue 44's broker profile, 1% of its samples)."""
    return CREATES.labels(strategy, "placed"), CREATE_SECONDS.labels(strategy)


async def measured(strategy: str, create: Callable[[], Awaitable[T]], outcome_of: Callable[[T], Outcome | None]) -> T:
    """Run one create, counting its outcome (`placed`, or the error's HTTP code) and its latency."""
    started = time.perf_counter()
    try:
        result = await create()
    except FauxmadError as exc:
        CREATES.labels(strategy, str(exc.code)).inc()
        raise
    placed, seconds = _placed(strategy)
    placed.inc()
    seconds.observe(time.perf_counter() - started)
    outcome = outcome_of(result)
    if outcome is not None:
        ASKED.observe(outcome.asked)
        ANSWERED.observe(outcome.answered)
        SHARED.observe(outcome.shared)
    return result
