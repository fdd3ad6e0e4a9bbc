"""The merged watch of a supercluster's per-region buckets: its initial values are in once the regions that could
answer did, when every other region's watch could not even be made (cut off).

A broker restarted in a region about to be cut off waited the whole initial timeout on each watch of a region it
could not reach before it served its own (the nemesis on hosts, seed 105). Fakes stand in for the buckets: what is
under test is the merging, not NATS (the real regions are in tests/supercluster).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from bus.contract.codec import encode
from bus.contract.fleet import WorkerInfo
from bus.contract.offers import Resources
from bus.transport.regional import MergedWatch
from orchestrator.replicas.workers import Registry
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


def test_a_region_not_read_yet_is_unread_and_a_registry_waits_for_it_bounded() -> None:
    """A deploy judges a region by its workers only once they were read: `unread` names the regions whose initial
    values never came (CI105: a supercluster region's JetStream out for seconds after the start read as "no live
    workers in syd"), and the registry waits for them, bounded."""

    class Beats:
        """mad's bucket: one worker's heartbeat, as a KV watch delivers it, then the end of the initial values."""

        async def watchall(self) -> Any:
            async def entries() -> Any:
                info = WorkerInfo(worker_id="w1", region="mad", capacity=Resources(1, 64), used=Resources())
                yield SimpleNamespace(key="mad.w1", value=encode(info), operation=None, revision=1)
                yield None
                await asyncio.Event().wait()

            return entries()

    class Regions:
        buckets = {"mad": Beats(), "syd": CutOff()}

        async def watchall(self) -> MergedWatch:
            return MergedWatch(self.buckets, NEVER)  # type: ignore[arg-type]

    async def main() -> tuple[frozenset[str], frozenset[str], frozenset[str], float]:
        registry = Registry()
        await registry.start(Regions(), timeout=30)  # type: ignore[arg-type]
        assert registry.live_ids("mad") == {"w1"}
        try:
            began = time.perf_counter()
            waited = await registry.read({"syd"}, 0.5)
            took = time.perf_counter() - began
            return registry.unread(), waited, await registry.read({"mad"}, 30), took
        finally:
            await registry.close()

    unread, waited, mad, took = arun(main())
    assert unread == {"syd"} and waited == {"syd"} and mad == frozenset()
    assert took >= 0.5  # bounded, and not given up before its bound: syd never answers here
