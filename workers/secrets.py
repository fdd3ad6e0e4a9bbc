"""The worker's side of app secrets: a watched copy of the sealed secrets, opened only at a machine's start.

The worker watches KV `fauxmad_secrets` and keeps what it sees sealed, in memory (so a start never waits
on the bus); `env_for(app)` opens that app's secrets for the environment of a machine being started (and
its checks and `exec`, which run in the same environment). Clear values live in that environment only:
never in LMDB, events, logs, heartbeats or the index.

A worker started without a secrets key can run every app that has no secrets; a machine of an app that
has some fails to start with a reason that says so. A worker with a key publishes its public half in the
bucket (`public_key`) if none is there, so `fauxmad secrets set` can seal without a key of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey

from bus.stores.secrets import PUBLIC_KEY, SealedSecret, public_key_text, unseal
from bus.transport.nats_adapter import KV

log = logging.getLogger(__name__)


class SecretsUnavailable(Exception):
    """The app has secrets this worker cannot open."""


class SecretsCache:
    def __init__(self, private_key: PrivateKey | None) -> None:
        self._key = private_key
        self._sealed: dict[str, dict[str, SealedSecret]] = {}  # app -> name -> sealed
        self._task: asyncio.Task[None] | None = None

    async def start(self, kv: KV) -> None:
        """Publish the public key if the bucket has none, then follow the bucket (initial values first)."""
        if self._key is not None:
            mine = public_key_text(self._key)
            try:
                entry = await kv.get(PUBLIC_KEY)
                if entry.value and entry.value.decode() != mine:
                    log.error("this worker's secrets key is not the fleet's: apps' secrets will not open here")
            except Exception:  # not there yet: ours becomes the fleet's (create: a racing worker's wins)
                with contextlib.suppress(Exception):
                    await kv.create(PUBLIC_KEY, mine.encode())
        watcher = await kv.watchall()
        async for entry in watcher:  # the initial values, up to the marker (None)
            if entry is None:
                break
            self._apply(entry)
        self._task = asyncio.create_task(self._follow(watcher))

    async def _follow(self, watcher: Any) -> None:
        async for entry in watcher:
            if entry is not None:
                self._apply(entry)

    def _apply(self, entry: Any) -> None:
        app, _, name = entry.key.partition(".")
        if not name:
            return  # the public key
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self._sealed.get(app, {}).pop(name, None)
            return
        try:
            self._sealed.setdefault(app, {})[name] = msgspec.json.decode(entry.value, type=SealedSecret)
        except msgspec.DecodeError:
            log.warning("secret %s of app %s is malformed: ignored", name, app)

    def env_for(self, app: str) -> dict[str, str]:
        """The app's secrets in clear, for a machine's environment; raises `SecretsUnavailable` when it has
        some and this worker cannot open them."""
        sealed = self._sealed.get(app)
        if not sealed:
            return {}
        if self._key is None:
            raise SecretsUnavailable(
                f"app {app} has secrets and this worker has no secrets key (fauxmad worker --secrets-key FILE)"
            )
        try:
            return {name: unseal(self._key, secret.sealed) for name, secret in sealed.items()}
        except (CryptoError, ValueError) as exc:
            raise SecretsUnavailable(f"app {app}'s secrets do not open with this worker's key: {exc}") from None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
