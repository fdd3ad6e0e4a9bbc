"""The one table of per-verb waits: every hop nearer the user waits longer than the hop it asks, for every verb."""

from __future__ import annotations

import pytest

from bus.contract.deadlines import HOP_MARGIN, OWN_TIMEOUT_WAIT, broker_wait, caller_wait
from bus.contract.verbs import API_REQUESTS


@pytest.mark.parametrize("verb", sorted(API_REQUESTS))
def test_the_broker_gives_up_on_a_worker_before_its_caller_gives_up_on_the_broker(verb: str) -> None:
    for own in (None, 0.0, 10.0, 3600.0):
        assert 0 < broker_wait(verb, own) == caller_wait(verb, own) - HOP_MARGIN


@pytest.mark.parametrize("verb", sorted(OWN_TIMEOUT_WAIT))
def test_a_verb_with_a_timeout_of_its_own_is_waited_for_that_long_and_more(verb: str) -> None:
    assert caller_wait(verb, 3600.0) > 3600.0
    assert broker_wait(verb, 3600.0) > 3600.0  # the worker's own timeout passes before the broker gives up


def test_a_clients_base_moves_every_verb_without_a_timeout_of_its_own() -> None:
    assert caller_wait("create", base=1.0) < caller_wait("create") and caller_wait("get", base=1.0) == 1.0
