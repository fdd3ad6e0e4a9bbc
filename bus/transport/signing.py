"""Signing a connection's API requests with its nkey, for the audit trail (`bus.transport.audit` checks them).

Its own module because the connection carries a signer (`bus.transport.nats_adapter.Connection.signer`) and the
audit trail, which checks what it signs, stands above the connection; `bus.transport.audit` says what the
signature covers and why.
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Callable

IDENTITY_HEADER = "Fauxmad-Identity"
SIGNED_AT_HEADER = "Fauxmad-Signed-At"
NAME_HEADER = "Fauxmad-Name"
SIGNATURE_HEADER = "Fauxmad-Signature"


def signed_bytes(subject: str, signed_at: str, name: str, data: bytes) -> bytes:
    return b"\n".join((subject.encode(), signed_at.encode(), name.encode(), hashlib.sha256(data).digest()))


class RequestSigner:
    """Signs a connection's API requests with its nkey (`bus.transport.connection.connect` attaches one to a secure
    connection: its `signer`)."""

    def __init__(self, seed: str, name: str, clock: Callable[[], float] = time.time) -> None:
        import nkeys

        self._keys = nkeys.from_seed(seed.encode())
        self.public_key = self._keys.public_key.decode()
        self.name = name
        self._clock = clock

    def headers(self, subject: str, data: bytes) -> dict[str, str]:
        signed_at = str(int(self._clock() * 1000))
        signature = self._keys.sign(signed_bytes(subject, signed_at, self.name, data))
        return {
            IDENTITY_HEADER: self.public_key,
            SIGNED_AT_HEADER: signed_at,
            NAME_HEADER: self.name,
            SIGNATURE_HEADER: base64.urlsafe_b64encode(signature).decode(),
        }
