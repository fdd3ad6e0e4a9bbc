"""Ending a KV watch without leaving its consumer behind on the server.

nats-py's `KeyValue.watch` makes an ordered consumer with an inactive threshold of five minutes, and its
`stop()` only unsubscribes: the consumer stays on the server for those five minutes. nats-server refuses a
stream's consumer past its limit (1,000 by default in recent servers: "maximum consumers limit reached"), so a
process that watches per request (`job wait` over NATS or HTTP, a console page, a worker listing an app's
jobs) ran out of consumers after about a thousand requests in five minutes (`bench jobs --samples 1000`).
`stop_watch` stops the watch and deletes its consumer at once. The delete is one JetStream request; every role
that may read a stream may delete consumers of it (`orchestrator/security/roles.py`).
"""

from __future__ import annotations

import contextlib

from bus.transport.nats_adapter import Watcher, watch_consumer


async def stop_watch(watcher: Watcher) -> None:
    """Stop `watcher` (a nats-py `KeyWatcher`) and delete its consumer; a failed delete is left to the server's
    inactive threshold."""
    consumer = watch_consumer(watcher)  # nats-py keeps it on the watch's subscription only: read before the stop
    await watcher.stop()
    if consumer is not None:
        js, stream, name = consumer
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)
