"""Which of a broker's JetStream-backed parts are ready: each is made in the background, after the broker answers.

Why: a broker that bound its buckets and started its watches before it subscribed to its API subjects was deaf
for as long as JetStream could not answer it. Restarted in a region cut off from the others (nemesis on hosts,
seed 105), it took 12 s to start, longer than the cut: no JetStream metadata leader there, so no new consumer (a
watch) could be made, and every create of the cut got "nobody answers" (NoResponders), although an unkeyed create
needs no store at all (an auction over core NATS, with the workers' heartbeats heard as they are published). So
the broker subscribes first and makes each part here, asking again until it is made (never exiting). A verb
that needs a part not made yet waits for it up to `NEED_WAIT`, then answers the contract's 503 naming it
(`Unavailable`): a keyed create needs the idempotency claims, a volume verb the volume stores, a push the image
store, a per-machine verb the machine index when it does not know the machine yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from bus.contract.errors import Unavailable

log = logging.getLogger(__name__)

FIRST_RETRY = 0.5  # seconds before a part that failed is asked again; doubled each time up to `LAST_RETRY`
LAST_RETRY = 4.0
NEED_WAIT = 2.0  # seconds a verb waits for a part it needs before its 503
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
        self._made: dict[str, asyncio.Event] = {}

    def ready(self, part: str) -> bool:
        return part in self._ready

    async def need(self, part: str, within: float = NEED_WAIT) -> None:
        """Return once `part` is made, waiting up to `within` seconds (a broker that has just started makes every
        part in about a second: its first requests wait rather than fail); then raise `Unavailable` (503)."""
        if part in self._ready:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event(part).wait(), within)
        if part not in self._ready:
            raise Unavailable(
                f"broker {self.owner}: {part} not ready yet (JetStream does not answer it now): try again in a few"
                " seconds"
            )

    def _event(self, part: str) -> asyncio.Event:
        return self._made.setdefault(part, asyncio.Event())

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
        self._event(part).set()
        if said:
            log.warning("broker %s: %s ready", self.owner, part)
