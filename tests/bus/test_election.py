"""A JetStream read waits through a meta-leader election (its 503s) and says so in words when none ends in time."""

from __future__ import annotations

import pytest
from nats.js.errors import ServiceUnavailableError

from bus.contract.errors import Unreachable
from bus.transport import election
from tests.helpers import arun


def test_a_read_answered_503_is_made_again_until_the_leader_is_elected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(election, "RETRY_EVERY", 0.0)
    answers: list[object] = [ServiceUnavailableError(), ServiceUnavailableError(), "the keys"]
    asked = []

    async def ask() -> object:
        asked.append(1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert arun(election.through_election(ask, "the keys of KV_fauxmad_apps")) == "the keys"
    assert len(asked) == 3


def test_no_leader_within_the_wait_is_unreachable_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(election, "RETRY_EVERY", 0.0)
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # every look at the clock: one second later
        return now[0]

    async def ask() -> object:
        raise ServiceUnavailableError()

    with pytest.raises(Unreachable, match="the keys of KV_fauxmad_apps: JetStream has had no leader for 5s"):
        arun(election.through_election(ask, "the keys of KV_fauxmad_apps", within=5.0, clock=clock))


def test_other_errors_are_not_waited_for() -> None:
    async def ask() -> object:
        raise ValueError("not an election")

    with pytest.raises(ValueError):
        arun(election.through_election(ask, "anything"))
