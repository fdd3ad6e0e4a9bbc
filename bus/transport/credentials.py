"""A secure fleet's credentials file: who a process is on the bus and how it proves it.

One JSON file per identity, written by `fauxmad fleet add-worker|add-user` (readable by its owner
alone): the NATS URL, the identity's nkey seed (the server knows only the public key and the
permissions that go with it), its inbox prefix (it may subscribe only below it), and the CA, client
certificate and key for mutual TLS. Relative paths are relative to the file.

Every process connects through `bus.transport.connection.connect`, which reads this file when one is given or
named by `$FAUXMAD_CREDS`: so the worker, the broker and every CLI command become an identity with
no option of their own.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import msgspec

from bus.contract.errors import BadRequest

CREDS_ENV = "FAUXMAD_CREDS"


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str
    url: str
    seed: str
    inbox_prefix: str
    ca: str
    cert: str
    key: str
    secrets_key: str | None = None  # workers only: the fleet's secrets key (bus/stores/secrets.py)

    def connect_options(self, base: Path) -> dict[str, Any]:
        """nats-py `connect` keyword arguments: the nkey, the inbox prefix and an mTLS context."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(base / self.ca))
        context.load_cert_chain(str(base / self.cert), str(base / self.key))
        return {"nkeys_seed_str": self.seed, "inbox_prefix": self.inbox_prefix, "tls": context}

    def backhaul_server_context(self, base: Path) -> ssl.SSLContext:
        """A worker's backhaul listener: its certificate, and a client certificate from the fleet's CA required."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(base / self.ca))
        context.load_cert_chain(str(base / self.cert), str(base / self.key))
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def backhaul_client_context(self, base: Path) -> ssl.SSLContext:
        """An edge dialing a worker's backhaul: its own certificate, and the worker's from the fleet's CA. The
        worker is checked by the name its certificate was issued to (`worker-<id>`, `backhaul_peer_ok`), not by
        host name: its address may be the default the kernel picked, which no certificate issued earlier names."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(base / self.ca))
        context.check_hostname = False
        context.load_cert_chain(str(base / self.cert), str(base / self.key))
        return context


def peer_name(peercert: Any) -> str:
    """The common name of a verified peer certificate (`SSLObject.getpeercert()`), or ''."""
    return _subject(peercert, "commonName")


def peer_role(peercert: Any) -> str:
    """The role a verified peer certificate was issued for (its organizational unit), or '' (none written)."""
    return _subject(peercert, "organizationalUnitName")


def _subject(peercert: Any, attribute: str) -> str:
    if not isinstance(peercert, dict):
        return ""
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == attribute:
                return str(value)
    return ""


def default_path() -> str | None:
    return os.environ.get(CREDS_ENV) or None


def load(path: str | Path) -> tuple[Credentials, Path]:
    """The credentials in `path` and the directory their relative paths start from; a 400 in plain words
    when the file is missing or malformed."""
    file = Path(path)
    try:
        creds = msgspec.json.decode(file.read_bytes(), type=Credentials)
    except OSError as exc:
        raise BadRequest(f"cannot read credentials {file}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"credentials {file} are malformed: {exc}") from None
    return creds, file.parent
