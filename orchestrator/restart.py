"""A machine's restart (stop, then start) under one lease: the HTTP API's and the CLI's, taken here once.

Without a lease of its own from the stop to the start, an operator (`fauxmad reconcile --watch`) that sees
the machine stopped in between leases it to start it, and the restart's own start is then refused (409
"leased by fauxmad-reconciler@...") though nobody else asked for anything. A caller that holds a lease
already restarts under that one. Both doors ask the brokers through their own transport (`Ask`), so the
lease's terms (its holder, its length, its release) are written once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

from bus.contract.errors import FauxmadError
from bus.contract.machines import STOP_TIMEOUT_MAX, Lease, LeaseRequest, Machine, ReleaseRequest

T = TypeVar("T")

# the restart's own lease: the stop's timeout plus this, the start's 30 s and the requests' own time
RESTART_LEASE_MARGIN = 60.0


class Ask(Protocol):
    """`verb` of the app's machines asked of the brokers, its answer decoded as `into`."""

    def __call__(self, verb: str, request: Any, into: type[T], /) -> Awaitable[T]: ...


@contextlib.asynccontextmanager
async def restart_lease(
    ask: Ask, machine_id: str, stop_timeout: float, *, holder: str, given: str | None = None
) -> AsyncIterator[str]:
    """The lease nonce a restart's stop and start carry: the caller's (`given`), or one of the restart's own,
    held from the stop to the start and given back after (it lapses by itself at the end of its ttl anyway)."""
    if given is not None:
        yield given
        return
    ttl = min(stop_timeout + RESTART_LEASE_MARGIN, STOP_TIMEOUT_MAX)
    held = await ask("lease", LeaseRequest(id=machine_id, ttl=ttl, holder=holder), Lease)
    try:
        yield held.nonce
    finally:
        with contextlib.suppress(FauxmadError, TimeoutError):
            await ask("release", ReleaseRequest(id=machine_id, nonce=held.nonce), Machine)
