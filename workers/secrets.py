"""The worker's side of app secrets: a watched copy of the sealed secrets, opened only at a machine's start.

The worker watches KV `fauxmad_secrets` and keeps what it sees sealed, in memory (so a start never waits
on the bus); `env_for(app)` opens that app's secrets for the environment of a machine being started (and
its checks and `exec`, which run in the same environment). Clear values live in that environment only:
never in LMDB, events, logs, heartbeats or the index.

A worker started without a secrets key can run every app that has no secrets; a machine of an app that
has some fails to start with a reason that says so. A worker with a key publishes its public half in the
bucket (`public_key`) if none is there, so `fauxmad secrets set` can seal without a key of its own.

The bucket is fleet-wide: in a supercluster it lives in the home region, which a worker of another region may
not reach when it starts (its region cut off: the nemesis on hosts, seed 103, a restarted worker exited). So the
worker keeps the sealed copy on its disk as well (`secrets.sealed.json` in its data dir: sealed as in the
bucket, readable by its key only), starts from that copy when the bucket does not answer within START_WAIT, and
follows the bucket as soon as it answers. A worker that has no copy waits up to FIRST_WAIT (a fleet starting up
may take that long), and if the bucket still does not answer it refuses to open any app's secrets
(`SecretsUnavailable`, saying why) until it does, rather than start a machine without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import msgspec
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey

from bus.stores.secrets import PUBLIC_KEY, SealedSecret, public_key_text, unseal
from bus.transport.nats_adapter import KV

log = logging.getLogger(__name__)

START_WAIT = 3.0  # seconds the start waits for the bucket before using the copy on disk
FIRST_WAIT = 30.0  # ... when there is no copy (a new worker): a fleet starting up may take that long to answer
RETRY = 3.0  # seconds between tries to follow a bucket that did not answer


class SecretsUnavailable(Exception):
    """The app has secrets this worker cannot open."""


class SecretsCache:
    def __init__(self, private_key: PrivateKey | None, saved: Path | None = None) -> None:
        self._key = private_key
        self._sealed: dict[str, dict[str, SealedSecret]] = {}  # app -> name -> sealed
        self._task: asyncio.Task[None] | None = None
        self._saved = saved  # the sealed copy on disk
        self._known = False  # the bucket or the copy on disk was read: `_sealed` is what the fleet has (or had)

    async def start(self, kv: KV) -> None:
        """Publish the public key if the bucket has none, then follow the bucket (initial values first); if it
        does not answer within START_WAIT, start from the copy on disk and follow the bucket once it answers."""
        copy = self._saved is not None and self._saved.exists()
        try:
            watcher = await asyncio.wait_for(self._read(kv), START_WAIT if copy else FIRST_WAIT)
        except Exception as exc:
            self._load()
            log.warning(
                "the fleet's secrets do not answer now (%r): %s; following them as soon as they answer",
                exc,
                "using the copy on disk" if self._known else "no copy on disk: no machine starts until they answer",
            )
            self._task = asyncio.create_task(self._retry(kv))
            return
        self._task = asyncio.create_task(self._follow(watcher))

    async def _read(self, kv: KV) -> Any:
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
        sealed: dict[str, dict[str, SealedSecret]] = {}
        async for entry in watcher:  # the initial values, up to the marker (None)
            if entry is None:
                break
            self._apply(entry, sealed)
        self._sealed, self._known = sealed, True
        self._save()
        return watcher

    async def _retry(self, kv: KV) -> None:
        while True:
            await asyncio.sleep(RETRY)
            try:
                watcher = await asyncio.wait_for(self._read(kv), START_WAIT * 2)
            except Exception:
                continue
            log.info("the fleet's secrets answer again: following them")
            await self._follow(watcher)
            return

    async def _follow(self, watcher: Any) -> None:
        async for entry in watcher:
            if entry is not None:
                self._apply(entry, self._sealed)
                self._save()

    def _save(self) -> None:
        if self._saved is None:
            return
        try:
            tmp = self._saved.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode(self._sealed))
            tmp.chmod(0o600)
            os.replace(tmp, self._saved)
        except OSError as exc:
            log.warning("the copy of the fleet's secrets could not be written (%s)", exc)

    def _load(self) -> None:
        if self._saved is None or not self._saved.exists():
            return
        try:
            self._sealed = msgspec.json.decode(self._saved.read_bytes(), type=dict[str, dict[str, SealedSecret]])
            self._known = True
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("the copy of the fleet's secrets on disk cannot be read (%s): not used", exc)

    @staticmethod
    def _apply(entry: Any, sealed: dict[str, dict[str, SealedSecret]]) -> None:
        app, _, name = entry.key.partition(".")
        if not name:
            return  # the public key
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            sealed.get(app, {}).pop(name, None)
            return
        try:
            sealed.setdefault(app, {})[name] = msgspec.json.decode(entry.value, type=SealedSecret)
        except msgspec.DecodeError:
            log.warning("secret %s of app %s is malformed: ignored", name, app)

    def env_for(self, app: str) -> dict[str, str]:
        """The app's secrets in clear, for a machine's environment; raises `SecretsUnavailable` when it has
        some and this worker cannot open them, or when it could not read which secrets there are."""
        if not self._known:
            raise SecretsUnavailable(
                "the fleet's secrets (KV fauxmad_secrets) have not answered since this worker started and it has no"
                " copy of them: the machine starts once they answer"
            )
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
