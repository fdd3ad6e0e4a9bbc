"""JetStream's API while its cluster elects a meta leader: a read waits the election out instead of failing.

A clustered JetStream answers its API (`$JS.API.STREAM.INFO`, a consumer's create: every watch) with a 503,
"JetStream system temporarily unavailable", while it has no meta leader: after a server dies, or while a
supercluster's region that lost its quorum has its servers restarted, the others elect one within one to a few
seconds. Taken as a failure, one such answer ended a deploy that had converged ("unexpected error:
ServiceUnavailableError()": its last listing of the apps bucket came during an election; CI65: a read of a
release, after its machines were ready, during the meta leader's step-down in a supercluster whose region had lost
its quorum). A call that meets one is made again every `RETRY_EVERY` seconds for up to `ELECTION_WAIT`; a 503
after that is `Unreachable`, in words.

Where: the reads a command has no other answer for (the apps bucket's keys, values and watch: every deploy,
rollback and scale reads its releases there). Not in the connection itself, for every request: tried so (CI66), a
region cut off from the others (whose servers answer 503 for as long as the cut lasts, as they cannot reach the
meta leader) held its own operator's and workers' requests 10 s each instead of letting them fall back at once to
what they last saw, and its operator, failing over inside the cut, replaced the same machines over and over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.js.errors import ServiceUnavailableError

from bus.contract.errors import Unreachable

T = TypeVar("T")

ELECTION_WAIT = 10.0  # seconds a call waits for JetStream to elect its meta leader (it takes 1 to 9 s)
RETRY_EVERY = 0.25


async def through_election(
    ask: Callable[[], Awaitable[T]],
    what: str,
    *,
    within: float = ELECTION_WAIT,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """`await ask()`, made again while JetStream answers 503 (no meta leader), for up to `within` seconds."""
    give_up = clock() + within
    while True:
        try:
            return await ask()
        except ServiceUnavailableError:
            if clock() >= give_up:
                raise Unreachable(
                    f"{what}: JetStream has had no leader for {within:g}s (electing one); try again in a few seconds"
                ) from None
            await asyncio.sleep(RETRY_EVERY)
