"""Op log housekeeping: every `compact_every` seconds the LMDB log keeps its last records and forgets
machines destroyed long ago, off the event loop. A failed round is logged and the next one tries again."""

from __future__ import annotations

import asyncio
import logging

from workers.agent.config import WorkerConfig
from workers.log.store import Store

log = logging.getLogger(__name__)


async def compact_forever(store: Store, config: WorkerConfig) -> None:
    while True:
        await asyncio.sleep(config.compact_every)
        try:
            deleted = await asyncio.to_thread(
                store.compact,
                keep_last=config.log_keep_last,
                destroyed_retention=config.destroyed_retention,
            )
            if deleted:
                log.info("compacted %d log records", deleted)
        except Exception:
            log.warning("compaction failed", exc_info=True)
