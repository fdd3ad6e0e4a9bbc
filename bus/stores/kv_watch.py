"""Ending a KV watch without leaving its consumer behind on the server.

nats-py's `KeyValue.watch` makes an ordered consumer with an inactive threshold of five minutes, and its
`stop()` only unsubscribes: the consumer stays on the server for those five minutes. nats-server refuses a
stream's consumer past its limit (1,000 by default in recent servers: "maximum consumers limit reached"), so a
process that watches per request (`job wait` over NATS or HTTP, a console page, a worker listing an app's
jobs) ran out of consumers after about a thousand requests in five minutes (`bench jobs --samples 1000`).
`stop_watch` stops the watch and deletes its consumer at once. The delete is one JetStream request; every role
that may read a stream may delete consumers of it (`orchestrator/security/roles.py`).

`current_values` reads what a bucket holds now through one watch, without trusting nats-py's end-of-values
marker (`None`): nats-py queues it first when the consumer reports nothing pending and its callback has received
nothing yet, which on a loaded host is also the case when the server has already sent every value and the
callback has not run (`bus.stores.kv_keys` says the same of `keys()`; CI35: a worker answered `job list` with no
jobs for an app whose two jobs had just succeeded). The values' own count is not a race: each carries how many
the consumer still had to send (`delta`), so the read ends at the one with none left; a marker with nothing read
before it ends the read only when the consumer has delivered nothing at all.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from nats.js.kv import KeyValue

from bus.transport.nats_adapter import Watcher, watch_consumer

_GONE = ("DEL", "PURGE")


async def stop_watch(watcher: Watcher) -> None:
    """Stop `watcher` (a nats-py `KeyWatcher`) and delete its consumer; a failed delete is left to the server's
    inactive threshold."""
    consumer = watch_consumer(watcher)  # nats-py keeps it on the watch's subscription only: read before the stop
    await watcher.stop()
    if consumer is not None:
        js, stream, name = consumer
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)


async def current_values(kv: KeyValue, pattern: str, timeout: float) -> list[Any]:
    """The live entries (nats-py `KeyValue.Entry`) of `kv` whose keys match `pattern`, as they are now, in stream
    order; `TimeoutError` when they do not all come within `timeout` seconds. See the top for why the marker is
    not the end."""
    give_up = time.perf_counter() + timeout
    watcher: Any = await kv.watch(pattern)  # deletes too: the last value the consumer sends may be one
    latest: dict[str, Any] = {}
    seen = 0
    try:
        while True:
            left = give_up - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"the values of {pattern} did not all come within {timeout:g}s")
            try:
                entry = await watcher.updates(timeout=left)
            except TimeoutError:  # nats-py's is one
                continue
            if entry is None:
                if seen or await _delivered(watcher):
                    continue  # the marker came before the values it ends
                break  # nothing in the bucket matches
            seen += 1
            if entry.operation in _GONE:
                latest.pop(entry.key, None)
            else:
                latest[entry.key] = entry
            if entry.delta == 0:
                break
    finally:
        await stop_watch(watcher)
    return list(latest.values())


async def _delivered(watcher: Watcher) -> bool:
    """Whether the watch's consumer has sent anything yet (a value the callback has not run for)."""
    consumer = watch_consumer(watcher)
    if consumer is None:
        return False
    js, stream, name = consumer
    info = await js.consumer_info(stream, name)
    return bool(info.delivered and info.delivered.consumer_seq)
