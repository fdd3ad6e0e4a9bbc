"""`KVReplica.caught_up`: an answer that must not rest on a watch running behind waits for the watch to reach
the bucket's last sequence as read now, and no longer than it is told.

The proxy asks it before it answers an app "no machines" (orchestrator/proxy/pick.py): two files at a time,
a test created a machine and the proxy, whose watch had not delivered it yet, answered 502 "it has no
machines". A unit test over a stand-in bucket, so the watch's lag is the test's to set, not the host's.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from orchestrator.replicas.machines import MachineIndex
from tests.helpers import arun


class Bucket:
    """A KV bucket whose watch delivers an entry each time the test releases one."""

    def __init__(self, last_seq: int) -> None:
        self._stream = "KV_test"
        self._js = self
        self.last_seq = last_seq
        self.release: asyncio.Queue[Any] = asyncio.Queue()

    async def stream_info(self, stream: str) -> Any:
        return SimpleNamespace(state=SimpleNamespace(last_seq=self.last_seq))

    async def watchall(self) -> Any:
        return self

    def __aiter__(self) -> Any:
        return self

    async def __anext__(self) -> Any:
        return await self.release.get()

    async def stop(self) -> None:
        pass


def entry(key: str, revision: int) -> Any:
    value = b'{"id":"%s","app":"web","worker_id":"w1","region":"mad","state":"started"}' % key.encode()
    return SimpleNamespace(key=key, value=value, operation=None, revision=revision)


def test_caught_up_waits_for_the_watch_to_reach_the_last_sequence_read_now() -> None:
    async def main() -> tuple[bool, list[str]]:
        bucket = Bucket(last_seq=3)
        index = MachineIndex()
        bucket.release.put_nowait(None)  # the initial values: none
        await index.start(bucket, timeout=1)
        waiting = asyncio.create_task(index.caught_up(5.0))
        for n in (1, 2, 3):
            await asyncio.sleep(0.05)
            assert not waiting.done()  # the watch is behind: no answer yet
            bucket.release.put_nowait(entry(f"m{n}", n))
        answer = await waiting
        known = sorted(e.id for e in index.by_app("web"))
        await index.close()
        return answer, known

    answer, known = arun(main())
    assert answer is True
    assert known == ["m1", "m2", "m3"]  # once it says so, the machines created a moment ago are known


def test_caught_up_gives_up_at_its_bound_when_the_watch_stays_behind() -> None:
    async def main() -> bool:
        bucket = Bucket(last_seq=2)
        index = MachineIndex()
        bucket.release.put_nowait(None)
        await index.start(bucket, timeout=1)
        bucket.release.put_nowait(entry("m1", 1))  # the second never comes
        answer = await index.caught_up(0.2)
        await index.close()
        return answer

    assert arun(main()) is False


def test_a_bucket_that_cannot_tell_its_sequence_is_not_waited_for() -> None:
    async def main() -> bool:
        index = MachineIndex()
        index._kv = SimpleNamespace()  # a region-merged bucket: no one stream to read
        return await index.caught_up(5.0)

    assert arun(main()) is False
