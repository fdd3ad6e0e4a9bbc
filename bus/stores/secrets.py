"""App secrets at rest: sealed to the fleet's secrets key, so only workers can read them.

A secret (`fauxmad secrets set -a APP NAME=VALUE`) is stored in KV `fauxmad_secrets` under
`<app>.<NAME>`, its value sealed (libsodium sealed box: X25519 + XSalsa20-Poly1305, via PyNaCl) to the
fleet's public key. Workers hold the private key and open a secret only to put it in the environment of
a machine they start; the CLI, the brokers, the reconcilers and every stream see only the sealed bytes.
The public key is in the same bucket under `public_key` (no `.`: never an app's key), written by the
workers, so whoever sets a secret needs no key of its own.
"""

from __future__ import annotations

import base64
import re

import msgspec
from nacl.public import PrivateKey, PublicKey, SealedBox
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from bus.transport.jetstream import bind_or_create_kv

SECRETS_BUCKET = "fauxmad_secrets"
PUBLIC_KEY = "public_key"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")  # an environment variable's name
MAX_VALUE = 64 * 1024


class SealedSecret(msgspec.Struct, frozen=True, kw_only=True):
    """What the bucket holds for one secret: never the value in clear."""

    sealed: str  # base64 of the sealed box
    version: int
    updated_at: float


def secret_key(app: str, name: str) -> str:
    return f"{app}.{name}"


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"invalid secret name {name[:64]!r}: use letters, digits and '_' (an environment variable)")
    return name


def new_private_key() -> str:
    """A fresh fleet secrets key, base64 (what a worker's `--secrets-key` file holds)."""
    return base64.b64encode(bytes(PrivateKey.generate())).decode()


def load_private_key(text: str) -> PrivateKey:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
        return PrivateKey(raw)
    except Exception as exc:  # binascii.Error, nacl's ValueError/TypeError: all "not a key"
        raise ValueError(f"not a fauxmad secrets key (base64 of 32 bytes): {type(exc).__name__}") from None


def public_key_text(private: PrivateKey) -> str:
    return base64.b64encode(bytes(private.public_key)).decode()


def seal(public_key: str, value: str) -> str:
    box = SealedBox(PublicKey(base64.b64decode(public_key)))
    return base64.b64encode(box.encrypt(value.encode())).decode()


def unseal(private: PrivateKey, sealed: str) -> str:
    return SealedBox(private).decrypt(base64.b64decode(sealed)).decode()


async def secrets_bucket(js: JetStreamContext) -> KeyValue:
    return await bind_or_create_kv(
        js,
        KeyValueConfig(
            bucket=SECRETS_BUCKET,
            history=1,
            storage=StorageType.FILE,
            description="app secrets, sealed to the fleet's secrets key (workers alone can open them)",
        ),
    )
