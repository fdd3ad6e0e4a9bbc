"""What a new machine is stamped with: an instance id, ISO timestamps and a free port.

Pure helpers the verbs share, kept apart so the manager reads as transitions and nothing else. Each
runs once or twice per commit on the event loop, so each is written to cost a few microseconds:
`datetime.strftime` and a 26-step generator cost more than the rest of building the record.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Container

from bus.local.ports import PortRange, free_port, machine_ports

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = [high + low for high in _CROCKFORD for low in _CROCKFORD]  # every 10-bit value as two characters
_PAIR_SHIFTS = tuple(range(120, -1, -10))  # a ULID's 130 bits (2 leading zeros), 10 at a time


def new_instance_id(now: float) -> str:
    """A ULID (time-sortable, 26 Crockford base32 chars), as Fly uses for instance ids."""
    value = (int(now * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join([_PAIRS[(value >> shift) & 1023] for shift in _PAIR_SHIFTS])


def iso(ts: float) -> str:
    """`ts` as `YYYY-MM-DDTHH:MM:SS.mmmZ`, exactly as `datetime.fromtimestamp(ts, UTC)` rounds it
    (microseconds half to even, then cut to milliseconds)."""
    fraction, whole = math.modf(ts)
    micros = round(fraction * 1e6)
    seconds = int(whole)
    if micros >= 1_000_000:
        seconds, micros = seconds + 1, micros - 1_000_000
    elif micros < 0:  # before 1970
        seconds, micros = seconds - 1, micros + 1_000_000
    return f"{_second(seconds)}.{micros // 1000:03d}Z"


@functools.lru_cache(maxsize=4)
def _second(seconds: int) -> str:
    """The whole-second part: the same for every commit within that second."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def pick_port(held: Container[int] = (), within: PortRange | None = None) -> int:
    """A machine's `PORT`: below the ephemeral range, so no connection this host opens takes it (bus.local.ports),
    in this worker's range (`--machine-ports`, else the machines' half of the host's), and none of `held`, the
    ports of this worker's machines (a stopped one binds its port again when started)."""
    return free_port("127.0.0.1", held, within or machine_ports())  # local: a machine's port is on its host's loopback
