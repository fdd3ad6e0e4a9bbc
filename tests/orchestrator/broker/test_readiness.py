"""A broker's parts before JetStream answers (orchestrator/broker/readiness.py): a part not made is a 503 naming it
once the wait for it is over, a verb waits while it is made, a failing step is asked again until it is made, and one
that can never be made stops at once."""

from __future__ import annotations

import asyncio

import pytest

from bus.contract.errors import Unavailable
from bus.transport.fleet_layout import LayoutConflict
from orchestrator.broker import readiness
from orchestrator.broker.readiness import FLEET_BUCKETS, Readiness
from tests.helpers import arun


def test_a_part_not_made_is_a_503_naming_it_and_a_failing_step_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(readiness, "FIRST_RETRY", 0.001)
    tries: list[int] = []

    async def step() -> None:
        tries.append(1)
        if len(tries) < 3:
            raise TimeoutError("no answer")

    async def scenario() -> Readiness:
        parts = Readiness("b1")
        with pytest.raises(Unavailable) as refused:
            await parts.need(FLEET_BUCKETS, within=0.01)
        assert refused.value.code == 503 and refused.value.retry_after is not None
        assert refused.value.message.startswith(
            "broker b1: the fleet's buckets (layout, idempotency claims, apps) not ready"
        )
        waiting = asyncio.ensure_future(parts.need(FLEET_BUCKETS, within=10.0))  # a verb waits while it is made
        await parts.make(FLEET_BUCKETS, step)
        await waiting
        await parts.need(FLEET_BUCKETS, within=0.0)  # made: no refusal
        return parts

    assert arun(scenario()).ready(FLEET_BUCKETS) and len(tries) == 3


def test_a_part_that_can_never_be_made_is_not_asked_again() -> None:
    tries: list[int] = []

    async def step() -> None:
        tries.append(1)
        raise LayoutConflict("this process was told R1 but the fleet's layout is one cluster, R3")

    with pytest.raises(LayoutConflict):
        arun(Readiness("b1").make(FLEET_BUCKETS, step, fatal=(LayoutConflict,)))
    assert tries == [1]
