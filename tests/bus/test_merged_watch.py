"""The merged watch of a supercluster's per-region buckets: its initial values are in once the regions that could
answer did, when every other region's watch could not even be made (cut off).

A broker restarted in a region about to be cut off waited the whole initial timeout on each watch of a region it
could not reach before it served its own (the nemesis on hosts, seed 105). Fakes stand in for the buckets: what is
under test is the merging, not NATS (the real regions are in tests/supercluster).
"""

from __future__ import annotations

import asyncio
from typing import Any

from bus.transport.regional import MergedWatch
from tests.helpers import arun

NEVER = 3600.0  # an initial timeout no test waits for


class Answers:
    """A region's bucket that answers: one entry, then the end of its initial values, then nothing more."""

    async def watchall(self) -> Any:
        async def entries() -> Any:
            yield "mad.w1"
            yield None
            await asyncio.Event().wait()

        return entries()


class CutOff:
    """A region's bucket whose watch cannot be made (its cluster does not answer)."""

    async def watchall(self) -> Any:
        raise TimeoutError


def test_the_initial_values_are_in_once_the_own_region_answered_and_the_others_could_not_be_watched() -> None:
    async def main() -> list[Any]:
        merged = MergedWatch({"mad": Answers(), "syd": CutOff()}, NEVER)  # type: ignore[dict-item]
        try:
            return [await asyncio.wait_for(anext(merged), 30), await asyncio.wait_for(anext(merged), 30)]
        finally:
            await merged.stop()

    assert arun(main()) == ["mad.w1", None]


class Hangs:
    """A region's bucket whose watch is never made nor refused (its cluster cut off: the request is not answered)."""

    async def watchall(self) -> Any:
        await asyncio.Event().wait()


def test_a_region_that_did_not_answer_the_start_does_not_hold_up_the_initial_values() -> None:
    async def main() -> list[Any]:
        merged = MergedWatch({"mad": Answers(), "syd": Hangs()}, NEVER, frozenset({"syd"}))  # type: ignore[dict-item]
        try:
            return [await asyncio.wait_for(anext(merged), 30), await asyncio.wait_for(anext(merged), 30)]
        finally:
            await merged.stop()

    assert arun(main()) == ["mad.w1", None]


def test_with_no_region_answering_the_watch_waits_on() -> None:
    async def main() -> bool:
        merged = MergedWatch({"mad": CutOff(), "syd": CutOff()}, NEVER)  # type: ignore[dict-item]
        try:
            await asyncio.wait_for(anext(merged), 1.0)
        except TimeoutError:
            return True
        finally:
            await merged.stop()
        return False

    assert arun(main())  # JetStream itself pausing is not "no workers anywhere"
