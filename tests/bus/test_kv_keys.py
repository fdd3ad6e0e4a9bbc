"""`bus.stores.kv_keys` against a real nats-server: live keys only (a deleted or purged key is none), a filter
keeps its tokens, an empty bucket is no keys, and a bucket full of values is listed whole every time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from bus.stores.kv_keys import kv_keys
from tests.helpers import arun, connect_nats


def _on_nats(nats_url: str, body: Callable[[JetStreamContext], Awaitable[None]]) -> None:
    async def main() -> None:
        nc = await connect_nats(nats_url)
        try:
            await body(nc.jetstream())
        finally:
            await nc.close()

    arun(main())


def test_live_keys_under_a_filter(nats_url: str, unique: object) -> None:
    bucket = f"kvkeys_{unique('b')}"  # type: ignore[operator]

    async def main(js: JetStreamContext) -> None:
        kv: KeyValue = await js.create_key_value(bucket=bucket, history=5)
        assert await kv_keys(kv) == []  # an empty bucket: no keys, no NoKeysError
        for key in ("a.x", "a.y", "a.z", "b.x", "a.deep.one", "top"):
            await kv.put(key, b"v")
        await kv.put("a.x", b"v2")  # two messages on one subject: one key
        await kv.delete("a.y")  # its last message is a DEL marker
        await kv.purge("a.z")  # its only message is a PURGE marker
        await kv.put("b.gone", b"v")
        await kv.delete("b.gone")
        await kv.put("b.back", b"v")
        await kv.delete("b.back")
        await kv.put("b.back", b"again")  # a delete, then a value: live
        assert await kv_keys(kv) == ["a.deep.one", "a.x", "b.back", "b.x", "top"]
        assert await kv_keys(kv, "a.*") == ["a.x"]  # one token
        assert await kv_keys(kv, "a.>") == ["a.deep.one", "a.x"]
        assert await kv_keys(kv, "*.x") == ["a.x", "b.x"]
        assert await kv_keys(kv, "c.*") == []
        await kv.purge("a.x")
        assert await kv_keys(kv, "a.>") == ["a.deep.one"]

    _on_nats(nats_url, main)


def test_a_full_bucket_is_listed_whole(nats_url: str, unique: object) -> None:
    bucket = f"kvkeys_{unique('b')}"  # type: ignore[operator]

    async def main(js: JetStreamContext) -> None:
        kv: KeyValue = await js.create_key_value(bucket=bucket, history=1)
        keys = [f"app{i % 7}.k{i:04d}" for i in range(300)]
        for key in keys:
            await kv.put(key, b"x" * 100)
        for key in keys[::10]:
            await kv.delete(key)
        live = sorted(set(keys) - set(keys[::10]))
        for _ in range(5):
            assert await kv_keys(kv) == live
        assert await kv_keys(kv, "app3.*") == [k for k in live if k.startswith("app3.")]

    _on_nats(nats_url, main)


def test_a_bucket_with_no_stream(nats_url: str, unique: object) -> None:
    bucket = f"kvkeys_{unique('b')}"  # type: ignore[operator]

    async def main(js: JetStreamContext) -> None:
        kv: KeyValue = await js.create_key_value(bucket=bucket)
        await js.delete_key_value(bucket)
        with pytest.raises(NotFoundError):
            await kv_keys(kv)

    _on_nats(nats_url, main)
