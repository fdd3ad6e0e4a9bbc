"""Free TCP ports for servers this host starts: nats-servers (tests, `fauxmad dev`), machines' `PORT`.

The port the kernel gives for `bind(0)` comes from the ephemeral range, the same range every outgoing
connection's local port comes from. A port picked that way, released, and bound by a server a moment later
can be taken meanwhile by any connection this host opens: a supercluster picks 27 ports and then starts its
servers one after another, and the routes and gateways of the first servers took a port picked for a later
one (CI saw a nats-server exit at start). So the port is a random one below that range, that binds now,
and that this process has not handed out recently; `bind(0)` only where the range leaves no room below it.
`$FAUXMAD_PORT_RANGE` (`LOW-HIGH`) confines the picks to a range of one's own (a firewall's, or a slice per
parallel test runner, so two of them never pick the same port); every process started with it follows it.
"""

from __future__ import annotations

import functools
import os
import random
import socket
from collections.abc import Container
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_LOW = 32768
LOWEST_PICKED = 10_000  # below this, the ports that well-known services listen on
RECENT = 4096  # ports handed out lately, not handed out again: the servers they are for may not listen yet
TRIES = 200

RANGE_ENV = "FAUXMAD_PORT_RANGE"

_recent: dict[int, None] = {}  # insertion ordered: the oldest goes first


def free_port(host: str = "127.0.0.1", held: Container[int] = ()) -> int:
    """A port nothing listens on now, that no outgoing connection will take, not handed out lately, and not
    in `held` (ports the caller has given to servers that do not listen now: a worker's stopped machines)."""
    lowest, low, confined = _pick_range()
    if low - lowest > 2 * RECENT or confined:
        for _ in range(TRIES):
            port = random.randint(lowest, low - 1)
            if port not in _recent and port not in held and _binds(host, port):
                _remember(port)
                return port
    for _ in range(TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in held:
            break
    return port


@functools.cache
def _pick_range() -> tuple[int, int, bool]:
    """[lowest, low) and whether $FAUXMAD_PORT_RANGE set them; else LOWEST_PICKED to the ephemeral range's start.
    Read once: a process's environment is set when it starts (every pick of a machine's port would parse it)."""
    first, _, last = os.environ.get(RANGE_ENV, "").partition("-")
    if first.isdigit() and last.isdigit() and 0 < int(first) <= int(last) < 65536:
        return int(first), int(last) + 1, True
    return LOWEST_PICKED, _ephemeral_low(), False


@functools.cache
def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_DEFAULT_LOW


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _remember(port: int) -> None:
    _recent[port] = None
    if len(_recent) > RECENT:
        del _recent[next(iter(_recent))]
