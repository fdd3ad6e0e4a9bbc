"""An idempotency store that does not answer (a JetStream stream's leader being elected) is an outage, not a lack
of capacity: the broker answers it as the contract's Unreachable (502, retry after 0.25 s; the CLI's exit 3), never
as 503 "no capacity ... idempotency store unavailable", and no worker is asked meanwhile."""

from __future__ import annotations

from typing import Any, cast

import pytest

from bus.contract.errors import NoCapacity, Unanswered, Unreachable
from bus.contract.machines import MachineConfig, ReserveRequest
from orchestrator.broker.auction import Auction, AuctionConfig, Outcome
from orchestrator.placement.stack import Ranking
from orchestrator.replicas.workers import Registry
from tests.helpers import arun


def test_an_idempotency_store_outage_is_unreachable_not_no_capacity() -> None:
    auction = Auction(cast(Any, None), cast(Any, None), Registry(), AuctionConfig())
    asked: list[str] = []

    async def reserve_on(worker_id: str, reserve: ReserveRequest) -> Any:
        asked.append(worker_id)
        raise AssertionError("no worker may be asked while the claim could not be written")

    async def record(worker_id: str) -> None:
        raise Unanswered("idempotency store unavailable: nats: timeout")

    auction._reserve_on = reserve_on  # type: ignore[method-assign]
    reserve = ReserveRequest(app="web", region="mad", config=MachineConfig(cmd=["true"]), id="0123456789abcd")
    outcome = Outcome(
        region="mad",
        strategy="scatter",
        asked=2,
        answered=2,
        gather_ms=0.0,
        ranking=Ranking(candidates=[], rejected=[]),
    )
    with pytest.raises(Unreachable) as caught:
        arun(auction._reserve_in_order(["w1", "w2"], reserve, outcome, record))
    error = caught.value
    assert not isinstance(error, NoCapacity | Unanswered), error
    assert (error.code, error.retry_after) == (502, 0.25)
    assert "idempotency store unavailable" in error.message
    assert asked == [] and outcome.attempts == []
    assert not any(auction.picks._by_worker.values())  # the pick made for w1 was dropped
