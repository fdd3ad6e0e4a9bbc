"""Machine ids: 14 hex characters, chosen by whoever starts a machine's life.

A broker picks the id before its auction, so every reserve it sends for one create (the first try,
the probe after a timeout, a retry by another broker that took the create over) names the same
machine, and a worker that already holds it answers with it instead of reserving a second one.
"""

from __future__ import annotations

import secrets
import string


def new_machine_id() -> str:
    return secrets.token_hex(7)


_ALPHABET = string.digits + string.ascii_lowercase


def new_volume_id() -> str:
    """`vol_` and 16 lowercase letters or digits (Fly's shape). The broker picks it, so a re-sent create
    names the same volume and the worker answers with the one it made."""
    return "vol_" + "".join(secrets.choice(_ALPHABET) for _ in range(16))


def new_snapshot_id() -> str:
    return "vs_" + "".join(secrets.choice(_ALPHABET) for _ in range(16))
