"""A supercluster's fleet-wide streams and buckets, bound without waiting on a home region that does not answer.

Why: in a supercluster the fleet-wide things (the apps bucket, the fleet's events and logs streams, the audit
stream, secrets, images, volume snapshots) live in the home region (`bus.transport.layout`). A worker or broker
of another region binds them at its start. While its region was cut off from home, that start waited on each of
them in turn and then failed: a worker restarted in a cut-off region exited with `unexpected error:
ServiceUnavailableError()`, and a broker restarted just before a cut answered nothing for the whole cut (the
nemesis on hosts, seeds 103 and 105). Nothing a region needs to place and serve its own machines lives at home,
so the region must come up without it.

So each fleet-wide bind goes through `at_home`: in a supercluster it waits OTHER_REGION_WAIT at the most, and a
home region that does not answer (no answer, no responders, JetStream unavailable) is bound unseen, as
`bus.transport.jetstream` binds another region that does not answer: a handle made without a round trip, whose
uses fail one at a time until the home region answers again. Once home was found silent, the next binds of the
same connection go unseen at once for HOME_QUIET seconds, so a start does not wait on each in turn. A bucket that
is not there (NotFound) is still that, for the caller to create; outside a supercluster nothing changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from bus.contract.errors import Unreachable
from bus.transport.fleet_layout import known_layout

log = logging.getLogger(__name__)

T = TypeVar("T")

HOME_WAIT = 3.0  # seconds a fleet-wide bind waits for the home region (as for another region: OTHER_REGION_WAIT)
HOME_QUIET = 10.0  # seconds the next binds go unseen at once after the home region did not answer

_silent_until: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _connection(js: JetStreamContext) -> Any:
    return getattr(js, "_nc", js)


def home_silent(js: JetStreamContext) -> None:
    """The home region did not answer this connection just now (its state buckets, `jetstream._regions`): the
    next fleet-wide binds go unseen at once, for HOME_QUIET seconds."""
    _silent_until[_connection(js)] = time.monotonic() + HOME_QUIET


async def at_home(js: JetStreamContext, what: str, ask: Callable[[], Awaitable[T]], unseen: Callable[[], T]) -> T:
    """`ask()` (bind or make the fleet-wide `what`), or in a supercluster whose home region does not answer now,
    `unseen()`: the same thing bound without a round trip."""
    layout = known_layout(js)
    if layout is None or not layout.supercluster:
        return await ask()
    nc = _connection(js)
    if time.monotonic() < _silent_until.get(nc, 0.0):
        return unseen()
    try:
        return await asyncio.wait_for(ask(), HOME_WAIT)
    except NotFoundError:
        raise
    except (Unreachable, TimeoutError, APIError) as exc:
        _silent_until[nc] = time.monotonic() + HOME_QUIET
        why = getattr(exc, "message", None) or getattr(exc, "description", None) or type(exc).__name__
        log.warning(
            "the home region (%s) does not answer for %s now (%s): bound unseen, read as soon as it answers",
            layout.home,
            what,
            why,
        )
        return unseen()
