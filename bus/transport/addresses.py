"""Which address of this host another host reaches: the worker's advertised address, the edge's own addresses.

The default a worker advertises is the source address the kernel picks to reach its NATS server (a UDP
socket's `connect` does the route look-up and sends nothing): the interface that reaches the fleet's bus
is the one the fleet's other hosts share with this one (Nomad's default is the first private address; this
one also picks the right interface on a host with several). On a fleet whose NATS is on loopback, every
part is on this host and loopback is right.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from urllib.parse import urlsplit

LOOPBACK = "127.0.0.1"  # local: what a host is to itself


def source_address(host: str, port: int) -> str:
    """The local address this host would use to reach `host:port` (loopback for a loopback `host`); raises
    OSError when no route reaches it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(sockaddr)
            except OSError as exc:
                error = exc
                continue
            return str(probe.getsockname()[0])
    raise error or OSError(f"no address of {host}")


def source_address_for_url(url: str) -> str:
    """`source_address` toward the server a NATS URL names (its first, when it lists several)."""
    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    return source_address(parts.hostname or LOOPBACK, parts.port or 4222)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"  # local: a name for loopback


def host_addresses() -> set[str]:
    """Addresses this host answers at, as far as the resolver and the routing table tell without privileges:
    loopback, its host name's addresses, and the source address toward a public and a private range."""
    found = {LOOPBACK, "::1", "localhost"}  # local: loopback, always
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            found.add(str(info[4][0]))
    for probe in ("192.0.2.1", "10.255.255.254"):  # TEST-NET-1 and a private range: a route look-up only
        with contextlib.suppress(OSError):
            found.add(source_address(probe, 9))
    return found


def bindable(address: str) -> bool:
    """Whether this host holds `address` (a socket can bind it)."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True
