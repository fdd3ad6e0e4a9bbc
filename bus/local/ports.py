"""Free TCP ports for servers this host starts: nats-servers (tests, `fauxmad dev`), machines' `PORT`.

The port the kernel gives for `bind(0)` comes from the ephemeral range, the same range every outgoing
connection's local port comes from. A port picked that way, released, and bound by a server a moment later
can be taken meanwhile by any connection this host opens: a supercluster picks 27 ports and then starts its
servers one after another, and the routes and gateways of the first servers took a port picked for a later
one (CI saw a nats-server exit at start). So the port is a random one below that range, that binds now,
and that this process has not handed out recently; `bind(0)` only where the range leaves no room.
`$FAUXMAD_PORT_RANGE` (`LOW-HIGH`) confines the picks to a range of one's own (a firewall's, or a slice per
parallel test runner, so two of them never pick the same port); every process started with it follows it.

A process remembers only its own picks, and a port picked is bound only when the server it is for has started
(a second or two for a Python process on a busy host). Two processes picking in one range can hand out the same
port in that window: CI saw an edge's port taken by a machine the operator started while the edge came up, and
two workers of one dev fleet giving one port to two machines. So the range is split, never shared:
- its lower half is for servers a process starts itself (`free_port`: nats-servers, edges, metrics);
- its upper half is for machines (`machine_ports`): a worker picks its machines' ports in the range its
  `--machine-ports` gives (Nomad's clients have a dynamic port range the same way), by default that whole half;
- a process that starts workers gives each one a slice of that half to itself (`MachineSlices`), so no two
  of its workers pick the same port.
"""

from __future__ import annotations

import functools
import os
import random
import socket
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_LOW = 32768
LOWEST_PICKED = 10_000  # below this, the ports that well-known services listen on
RECENT = 4096  # ports handed out lately, not handed out again: the servers they are for may not listen yet
MIN_ROOM = 64  # a range smaller than this is not picked in at random: `bind(0)`
TRIES = 200
SLICES = 16  # slices of the machines' half: a dev fleet's (or a test's) worker processes alive at once

RANGE_ENV = "FAUXMAD_PORT_RANGE"


@dataclass(frozen=True, order=True)
class PortRange:
    """Ports `low` to `high`, both included, as `LOW-HIGH` writes them."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """`LOW-HIGH`, or ValueError saying what is wrong in plain words."""
        first, dash, last = text.strip().partition("-")
        if not (dash and first.isdigit() and last.isdigit()):
            raise ValueError(f"{text!r} is not a port range LOW-HIGH (such as 20000-32000)")
        low, high = int(first), int(last)
        if not 0 < low <= high < 65536:
            raise ValueError(f"{text!r}: ports go from 1 to 65535, the first no higher than the last")
        return cls(low, high)

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"

    @property
    def size(self) -> int:
        return self.high - self.low + 1

    def halves(self) -> tuple[PortRange, PortRange]:
        """The lower half (servers) and the upper half (machines); a one-port range is both."""
        middle = self.low + self.size // 2
        if middle > self.high:
            return self, self
        return PortRange(self.low, middle - 1), PortRange(middle, self.high)

    def slices(self, count: int) -> list[PortRange]:
        """`count` slices of equal size, in order (the last takes what is left); fewer if the range is smaller."""
        count = max(1, min(count, self.size))
        each = self.size // count
        starts = [self.low + i * each for i in range(count)]
        return [PortRange(start, (starts[i + 1] - 1) if i + 1 < count else self.high) for i, start in enumerate(starts)]


def free_port(host: str = "127.0.0.1", held: Container[int] = (), within: PortRange | None = None) -> int:
    """A port nothing listens on now, that no outgoing connection will take, not handed out lately, and not
    in `held` (ports the caller has given to servers that do not listen now: a worker's stopped machines).
    `within`: where to pick (default: the servers' half of this process's range)."""
    where = within or servers_range()
    if where.size >= MIN_ROOM:
        window = min(RECENT, where.size // 2)  # a small range (a worker's slice) comes round again sooner
        for _ in range(TRIES):
            port = random.randint(where.low, where.high)
            if not _handed.lately(port, window) and port not in held and _binds(host, port):
                _handed.remember(port)
                return port
    for _ in range(TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in held:
            break
    return port


def servers_range() -> PortRange:
    """Where `free_port` picks by default: the lower half of this process's range."""
    return _process_range().halves()[0]


def machine_ports() -> PortRange:
    """Where a worker picks its machines' ports when `--machine-ports` does not say: the upper half."""
    return _process_range().halves()[1]


class MachineSlices:
    """Slices of the machines' half for the worker processes one process starts, each to one worker at a time.

    `take` gives a slice nobody holds, or the whole half when all are held (the workers then share it, as they
    all did before slices); `give_back` returns one when its worker is gone for good. The first slice handed out
    depends on the process id, so two processes that each start workers (a test runner and the `fauxmad dev` it
    started) most likely begin at different slices."""

    def __init__(self, whole: PortRange, count: int = SLICES, start: int | None = None) -> None:
        self.whole = whole
        parts = whole.slices(count)
        turn = (os.getpid() if start is None else start) % len(parts)
        self.free = parts[turn:] + parts[:turn]

    def take(self) -> PortRange:
        return self.free.pop(0) if self.free else self.whole

    def give_back(self, part: PortRange) -> None:
        if part != self.whole and part not in self.free:
            self.free.append(part)


@functools.cache
def machine_slices() -> MachineSlices:
    """This process's slices for the workers it starts (one set per process, so two fleets never share one)."""
    return MachineSlices(machine_ports())


@functools.cache
def _process_range() -> PortRange:
    """$FAUXMAD_PORT_RANGE, else LOWEST_PICKED to the ephemeral range's start. Read once: a process's environment
    is set when it starts (every pick of a machine's port would parse it)."""
    try:
        return PortRange.parse(os.environ.get(RANGE_ENV, ""))
    except ValueError:
        return PortRange(LOWEST_PICKED, max(LOWEST_PICKED, _ephemeral_low() - 1))


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


class _Handed:
    """The ports this process handed out lately, each with the number of the pick that handed it out."""

    def __init__(self) -> None:
        self.picks = 0
        self.numbers: dict[int, int] = {}  # insertion ordered: the oldest first

    def lately(self, port: int, window: int) -> bool:
        """Whether `port` was among the last `window` ports handed out."""
        number = self.numbers.get(port)
        return number is not None and self.picks - number < window

    def remember(self, port: int) -> None:
        self.picks += 1
        self.numbers.pop(port, None)  # to the end: the newest
        self.numbers[port] = self.picks
        if len(self.numbers) > RECENT:
            del self.numbers[next(iter(self.numbers))]

    def forget(self, port: int | None = None) -> None:
        """Forget `port`, or every port (tests)."""
        if port is None:
            self.numbers.clear()
        else:
            self.numbers.pop(port, None)


_handed = _Handed()
