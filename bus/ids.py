"""Machine ids: 14 hex characters, chosen by whoever starts a machine's life.

A broker picks the id before its auction, so every reserve it sends for one create (the first try,
the probe after a timeout, a retry by another broker that took the create over) names the same
machine, and a worker that already holds it answers with it instead of reserving a second one.
"""

from __future__ import annotations

import secrets


def new_machine_id() -> str:
    return secrets.token_hex(7)
