"""What a new machine is stamped with: an instance id, ISO timestamps and a free port.

Pure helpers the verbs share, kept apart so the manager reads as transitions and nothing else.
"""

from __future__ import annotations

import secrets
import socket
from datetime import UTC, datetime

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_instance_id(now: float) -> str:
    """A ULID (time-sortable, 26 Crockford base32 chars), as Fly uses for instance ids."""
    value = (int(now * 1000) << 80) | int.from_bytes(secrets.token_bytes(10), "big")
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def pick_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
