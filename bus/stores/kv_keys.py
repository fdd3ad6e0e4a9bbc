"""A KV bucket's keys, read from its stream's subjects rather than from nats-py's `KeyValue.keys()`.

`KeyValue.keys()` reads a watch and stops at its end-of-values marker, which nats-py queues as soon as the
consumer reports nothing pending and its callback has received nothing yet: on a loaded host that is also the
case when the server has already sent every value and the callback has not run, so `keys()` raised
NoKeysError or returned too few keys for a bucket full of values (CI: `fauxmad image ls`, 9f7e821; the same
race made `job wait` call fresh jobs unknown, b22b3ec). The stream's own state is not a race: `stream_info`
with a subjects filter lists every subject that has a message, in one reply.

A subject whose last message is a delete or purge marker (header `KV-Operation: DEL` or `PURGE`) still has a
message, so each subject's last message is read (`KeyValue.get`, which treats both markers as no key) and
those keys are left out, as `keys()` leaves them out. The listing waits through a meta-leader election
(`bus.transport.election`): `stream_info` is JetStream's API, which answers 503 until the cluster has a leader.
"""

from __future__ import annotations

import asyncio

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus.transport.election import through_election
from bus.transport.nats_adapter import kv_stream

_AT_ONCE = 32  # last-message reads in flight at a time


async def kv_keys(kv: KeyValue, pattern: str = ">") -> list[str]:
    """The bucket's live keys matching `pattern` (NATS wildcards: `*` one token, `>` the rest), sorted; `[]`
    when there are none. A bucket with no stream raises nats-py's NotFoundError, as any read of it does."""
    where = kv_stream(kv)  # nats-py keeps the bucket's stream and prefix ("$KV.<bucket>.") on the handle only
    assert where is not None, "a KV handle has its stream"
    prefix = where.prefix
    info = await through_election(
        lambda: where.js.stream_info(where.stream, subjects_filter=prefix + pattern), f"the keys of {where.stream}"
    )
    subjects = sorted(info.state.subjects or {})
    gate = asyncio.Semaphore(_AT_ONCE)

    async def live(subject: str) -> str | None:
        key = subject[len(prefix) :]
        async with gate:
            try:
                await kv.get(key, validate_keys=False)
            except KeyNotFoundError:  # deleted or purged (KeyDeletedError is one), or purged since the listing
                return None
        return key

    return [key for key in await asyncio.gather(*map(live, subjects)) if key is not None]
