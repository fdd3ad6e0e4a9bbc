"""Which of a broker's JetStream-backed parts are ready: each is made in the background, after the broker answers.

Why: a broker that bound its buckets and started its watches before it subscribed to its API subjects was deaf
for as long as JetStream could not answer it. Restarted in a region cut off from the others (nemesis on hosts,
seed 105), it took 12 s to start, longer than the cut: no JetStream metadata leader there, so no new consumer (a
watch) could be made, and every create of the cut got "nobody answers" (NoResponders), although an unkeyed create
needs no store at all (an auction over core NATS, with the workers' heartbeats heard as they are published). So
the broker subscribes first and makes each part here, asking again until it is made (never exiting); a verb that
needs a part not ready yet answers the contract's 503 naming it (`Unavailable`): a keyed create waits for the
idempotency claims, a volume verb for the volume stores, a push for the image store, a per-machine verb for the
machine index when it does not know the machine yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from bus.contract.errors import Unavailable

log = logging.getLogger(__name__)

FIRST_RETRY = 0.5  # seconds before a part that failed is asked again; doubled each time up to `LAST_RETRY`
LAST_RETRY = 4.0
READY_WAIT = 10.0  # seconds a broker's start waits for its parts before it says it serves (it answers already)

# the parts, as a reply names them
FLEET_BUCKETS = "the fleet's buckets (layout, idempotency claims, apps)"
REGISTRY = "the worker registry"
MACHINE_INDEX = "the machine index"
VOLUMES = "the volume stores"
AUDIT = "the audit stream"
IMAGES = "the image store"


class Readiness:
    def __init__(self, owner: str) -> None:
        self.owner = owner  # who is not ready, as a reply says it (the broker's id)
        self._ready: set[str] = set()

    def ready(self, part: str) -> bool:
        return part in self._ready

    def require(self, part: str) -> None:
        """Raise `Unavailable` (503) naming `part` unless it is ready."""
        if part not in self._ready:
            raise Unavailable(
                f"broker {self.owner}: {part} not ready yet (JetStream does not answer it now): try again in a few"
                " seconds"
            )

    async def make(
        self, part: str, step: Callable[[], Awaitable[None]], *, fatal: tuple[type[Exception], ...] = ()
    ) -> None:
        """Run `step` until it succeeds (said once in the log while it fails), then count `part` as ready; an
        exception of a `fatal` class is raised at once (asking again cannot change it)."""
        delay, said = FIRST_RETRY, False
        while True:
            try:
                await step()
                break
            except fatal:
                raise
            except Exception as exc:  # JetStream's timeouts and refusals, whatever their class
                if not said:
                    log.warning("broker %s: %s not ready (%s): asking again until it is", self.owner, part, exc)
                    said = True
                await asyncio.sleep(delay)
                delay = min(2 * delay, LAST_RETRY)
        self._ready.add(part)
        if said:
            log.warning("broker %s: %s ready", self.owner, part)
