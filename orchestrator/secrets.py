"""`fauxmad secrets`: seal an app's secrets for the workers, list their names, remove them, roll the app.

The CLI never holds a key that opens a secret: it seals each value to the fleet's public key (found in the
bucket, where the workers put it) and stores the sealed box (bus/stores/secrets.py). A change reaches machines
the way a deploy does, one machine at a time: each started machine of the app is restarted (its worker
opens the new secrets at start) and must come back up before the next one goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec

from bus.contract.errors import BadRequest, FauxmadError, NotFound
from bus.stores.kv_keys import kv_keys
from bus.stores.secrets import MAX_VALUE, PUBLIC_KEY, SealedSecret, check_name, seal, secret_key
from bus.transport.nats_adapter import KV, Entry
from orchestrator.client import FleetClient

Progress = Callable[[str], None]


class SecretInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What `secrets list` shows: never a value."""

    name: str
    version: int
    updated_at: float


def parse_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """`NAME=VALUE` arguments, checked: a 400 naming the first bad one."""
    values: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise BadRequest(f"expected NAME=VALUE, got {name[:64]!r}")
        try:
            check_name(name)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if len(value.encode()) > MAX_VALUE:
            raise BadRequest(f"secret {name} is over {MAX_VALUE // 1024} KiB")
        values[name] = value
    return values


def _value(entry: Entry) -> bytes:
    """An entry's value; KeyError for a delete marker's (none)."""
    if entry.value is None:
        raise KeyError(entry.key)
    return entry.value


async def set_secrets(kv: KV, app: str, values: dict[str, str], clock: Callable[[], float] = time.time) -> None:
    try:
        public = _value(await kv.get(PUBLIC_KEY)).decode()
    except Exception:
        raise NotFound(
            "this fleet has no secrets key yet: start a worker with --secrets-key (a secure fleet's workers"
            " have it in their credentials)"
        ) from None
    for name, value in values.items():
        version = 1
        try:
            previous = msgspec.json.decode(_value(await kv.get(secret_key(app, name))), type=SealedSecret)
            version = previous.version + 1
        except Exception:
            pass
        sealed = SealedSecret(sealed=seal(public, value), version=version, updated_at=clock())
        await kv.put(secret_key(app, name), msgspec.json.encode(sealed))


async def list_secrets(kv: KV, app: str) -> list[SecretInfo]:
    out: list[SecretInfo] = []
    for key in await kv_keys(kv, f"{app}.*"):
        name = key.partition(".")[2]
        try:
            sealed = msgspec.json.decode(_value(await kv.get(key)), type=SealedSecret)
        except Exception:
            continue
        out.append(SecretInfo(name=name, version=sealed.version, updated_at=sealed.updated_at))
    return sorted(out, key=lambda info: info.name)


async def unset_secrets(kv: KV, app: str, names: Sequence[str]) -> list[str]:
    """Delete the named secrets; returns those that were not there."""
    present = {info.name for info in await list_secrets(kv, app)}
    missing = [name for name in names if name not in present]
    for name in names:
        if name in present:
            await kv.delete(secret_key(app, name))
    return missing


async def rolling_restart(client: FleetClient, app: str, progress: Progress, *, up_for: float = 1.0) -> int:
    """Restart the app's started machines one at a time, each up again before the next; how many."""
    machines = [m for m in await client.list(app) if m.state == "started"]
    for n, machine in enumerate(machines, 1):
        progress(f"restarting {machine.id} ({n}/{len(machines)}) in {machine.region}")
        await client.stop(app, machine.id)
        started = await client.start(app, machine.id)
        result = await client.wait_up(app, started, up_for=up_for, timeout=60.0)
        if not result.up:  # as a deploy does: stop at the first machine that does not come back
            raise RollFailed(
                f"machine {machine.id} did not come back up: {result.problem}; the others were left as they were"
            )
    return len(machines)


class RollFailed(FauxmadError):
    """A machine did not come back up after its restart: the roll stopped there."""
