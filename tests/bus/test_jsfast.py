"""`bus.transport.jsfast` against a real nats-server: the same records nats-py's KV reads and writes, compare-and-set,
create over a delete marker, and a stream that is not there said in one line."""

from __future__ import annotations

import pytest

from bus.contract.errors import Unreachable
from bus.transport.jsfast import FastJetStream, FastKV, LostRace
from tests.helpers import arun, connect_nats


def test_records_read_and_written_as_nats_py_sees_them(nats_url: str, unique: object) -> None:
    bucket = f"jsfast_{unique('b')}"  # type: ignore[operator]

    async def main() -> None:
        nc = await connect_nats(nats_url)
        try:
            kv = await nc.jetstream().create_key_value(bucket=bucket, history=1)
            fast = FastKV(await FastJetStream(nc, timeout=2.0).start(), bucket)
            assert await fast.get("k") is None
            first = await fast.create("k", b"one")
            assert first is not None and await fast.create("k", b"again") is None  # there already
            assert (await kv.get("k")).value == b"one"
            second = await fast.update("k", b"two", first)
            with pytest.raises(LostRace):
                await fast.update("k", b"stale", first)  # someone wrote since
            assert await fast.get("k") == (b"two", second)
            await kv.put("k", b"three")  # a write through nats-py, read back here
            assert (await fast.get("k"))[0] == b"three"  # type: ignore[index]
            await kv.delete("k")
            assert await fast.get("k") is None  # a delete marker is no value
            assert await fast.create("k", b"four") is not None  # and a create writes over it
            assert (await kv.get("k")).value == b"four"
            with pytest.raises(Unreachable):
                await FastKV(fast.js, f"{bucket}_missing").get("k")  # no such stream: nobody answers
        finally:
            await nc.close()

    arun(main())
