"""nats-py, as the rest of fauxmad sees it: our connection type, the handle types, and the one place that reads
nats-py's private attributes.

Why one module: the architecture says nats is imported by the bus's transports and stores and the modules that
wire a process, and the rest of the code holds typed handles, not `Any`. So:

- `Connection` is our connection: nats-py's client with the fields a fleet's connection carries, typed (its
  request signer, its refusals watch, its role, the hooks to call when it drops), set by
  `bus.transport.connection.connect`. They used to be attributes stuck on nats-py's object with `setattr`.
- `Nats`, `JetStream`, `KV`, `ObjectStore`, `Msg`, `Subscription`, the errors and the JetStream settings are
  nats-py's, named here once: a module that passes a handle along imports its type from here, not from nats.
- `Bucket` and `Watcher` are protocols: what a reader of a bucket needs, one bucket or a bucket per region
  (`bus.transport.regional.RegionalKV`) alike.
- Five places need what nats-py keeps private: the replies a connection still awaits (`pending_replies`, to fail
  them when it drops), the connection under a JetStream handle (`connection_of`), a KV handle's stream
  (`kv_stream`), a KV watch's consumer (`watch_consumer`), and the commands a client has not written yet
  (`flushed`: nats-py's own flush can return before them). They are read here only, and
  `tests/bus/test_nats_adapter.py` fails if a nats-py upgrade moves them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import nats.errors as errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, ObjectMeta, StorageType, StreamConfig
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
    ObjectNotFoundError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

if TYPE_CHECKING:
    from bus.transport.refusals import Refusals
    from bus.transport.signing import RequestSigner

__all__ = [
    "KV",
    "APIError",
    "AckPolicy",
    "Bucket",
    "BucketNotFoundError",
    "Connection",
    "ConsumerConfig",
    "DeliverPolicy",
    "Entry",
    "JetStream",
    "KeyNotFoundError",
    "KeyWrongLastSequenceError",
    "Msg",
    "Nats",
    "NotFoundError",
    "ObjectMeta",
    "ObjectNotFoundError",
    "ObjectStore",
    "StorageType",
    "StreamConfig",
    "Subscription",
    "Watcher",
    "connection_of",
    "errors",
    "kv_stream",
    "on_reconnect",
    "pending_replies",
    "reconnected",
    "refusals_of",
    "role_of",
    "server_info",
    "signer_of",
    "watch_consumer",
]

Nats = Client  # any nats-py connection: ours (`Connection`), or a plain one (a test's, the benchmark's floor)
JetStream = JetStreamContext
KV = KeyValue
Entry = KeyValue.Entry


class Connection(Client):
    """A fleet's connection (`bus.transport.connection.connect` makes it): nats-py's client, and what fauxmad
    keeps with it. On a secure fleet every request fails at once with `Forbidden` when nats-server refuses its
    publish, nats-py's own JetStream and KV requests included (a `secrets set` of another app's key)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusals: Refusals | None = None  # the secure connection's refusals watch (`bus.transport.refusals`)
        self.signer: RequestSigner | None = None  # signs its API requests for the audit trail
        self.role: str | None = None  # the role its credentials name (None on an open fleet)
        self.disconnect_hooks: list[Callable[[], None]] = []  # called when it drops (`bus.transport.in_flight`)
        self.reconnect_hooks: list[Callable[[], None]] = []  # called when it is back (`on_reconnect`)
        self.noticing: asyncio.Task[None] | None = None  # the look that tells a close nats-py did not report

    async def close(self) -> None:
        """nats-py's close, which ends in the middle when it closes during a reconnect: it cancels the reconnect,
        whose half-made connection's close waiter is then cancelled too, and awaiting it raises CancelledError out
        of `close` (CI38: a test closing its agent's connection just after its server came back). The connection is
        closed all the same (nats-py set its state first), so that error is not passed on, unless this task itself
        is being cancelled."""
        try:
            await super().close()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            if self._closed_cb is not None:  # the part of nats-py's close the error skipped
                with contextlib.suppress(Exception):
                    await self._closed_cb()

    async def flush(self, timeout: int = 10) -> None:
        """nats-py's flush, once every command made before it is on the socket (`flushed`)."""
        await _write_pending(self)
        await super().flush(timeout)

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        asking = super().request(subject, payload, timeout=timeout, old_style=old_style, headers=headers)
        if self.refusals is None:
            return await asking
        return await self.refusals.guard(subject, asking)


def signer_of(nc: Client) -> RequestSigner | None:
    """The connection's request signer (a secure fleet's), None for an open fleet's or a plain nats-py client."""
    return nc.signer if isinstance(nc, Connection) else None


def refusals_of(nc: Client) -> Refusals | None:
    """The refusals watch of a secure connection, else None."""
    return nc.refusals if isinstance(nc, Connection) else None


def role_of(nc: Client) -> str | None:
    """The role of a secure connection's identity (its credentials say it), None for an open fleet's."""
    return nc.role if isinstance(nc, Connection) else None


class Watcher(Protocol):
    """A KV watch: its entries, a None once the initial values are in, until `stop`."""

    def __aiter__(self) -> Any: ...

    async def stop(self) -> Any: ...


class Bucket(Protocol):
    """What reads a KV bucket: one (nats-py's `KeyValue`) or a bucket per region (`RegionalKV`)."""

    async def get(self, key: str) -> Entry: ...

    async def put(self, key: str, value: bytes) -> int: ...

    async def watchall(self) -> Any: ...


# nats-py's private attributes: read here only (tests/bus/test_nats_adapter.py checks each is still there)


async def _write_pending(client: Client) -> None:
    if client.is_connected:
        await client._flush_pending(force_flush=True)  # returns once the flusher wrote what was pending


async def flushed(client: Client, timeout: int = 10) -> None:
    """Return once the server has every command `client` made so far: a subscription made just before is in place
    when a request from another connection comes. nats-py's `flush` writes its PING straight to the socket while
    the commands before it (the SUB) still wait in its pending buffer for its flusher task, so the server can
    answer the PING before it reads the SUB; on a loaded host another connection's request then came first and
    was refused 'no responders' (CI58c, CI69: `test_in_flight`; 3 of 500 subscribe-flush-request rounds under
    stress-ng, 0 of 500 with the pending commands written first). A fleet's `Connection.flush` does this itself."""
    await _write_pending(client)
    await client.flush(timeout)


def pending_replies(nc: Client) -> dict[str, asyncio.Future[Any]]:
    """The replies `nc` still awaits, by token (nats-py's `_resp_map`); empty if a later nats-py moved them."""
    waiting: dict[str, asyncio.Future[Any]] | None = getattr(nc, "_resp_map", None)
    return waiting or {}


def on_reconnect(client: Client, back: Callable[[], None]) -> Callable[[], None] | None:
    """Call `back` each time `client` has reconnected, and return what stops that; None when `client` does not
    report its reconnects (a plain nats-py client: a test's, the benchmark's floor), so the caller must look at
    `client.stats["reconnects"]` itself. Only our `Connection` reports them (`bus.transport.connection.connect`
    makes them). Why: a look at the counter five times a second, per logical worker, was the largest timer
    of a simulated fleet's process (issue 44)."""
    if not isinstance(client, Connection):
        return None
    hooks = client.reconnect_hooks
    hooks.append(back)
    return lambda: hooks.remove(back) if back in hooks else None


def reconnected(client: Client) -> None:
    """Tell `client`'s reconnect hooks that it is back (its `reconnected_cb`, `bus.transport.connection`)."""
    for back in list(getattr(client, "reconnect_hooks", ())):
        back()


def connection_of(js: object) -> Client | None:
    """The connection a JetStream handle sends through (nats-py's `_nc`), None for something else."""
    nc = getattr(js, "_nc", None)
    return nc if isinstance(nc, Client) else None


def server_info(nc: object) -> dict[str, Any]:
    """What the server said of itself when `nc` connected (nats-py's `_server_info`: its name, its cluster, its
    JetStream domain), empty when unknown."""
    info = getattr(nc, "_server_info", None)
    return info if isinstance(info, dict) else {}


@dataclass(frozen=True)
class KVStream:
    js: JetStreamContext  # the handle the bucket was opened with
    stream: str  # `KV_<bucket>`
    prefix: str  # `$KV.<bucket>.`


def kv_stream(kv: object) -> KVStream | None:
    """A KV handle's JetStream handle, stream and subject prefix (nats-py keeps them on the handle only); None
    for something else (a region-merged bucket)."""
    js, stream = getattr(kv, "_js", None), getattr(kv, "_stream", None)
    if js is None or stream is None:
        return None
    return KVStream(js=js, stream=stream, prefix=getattr(kv, "_pre", ""))


def watch_consumer(watcher: object) -> tuple[JetStreamContext, str, str] | None:
    """A KV watch's JetStream handle, stream and consumer (nats-py keeps them on its subscription only), None
    when it has none."""
    sub = getattr(watcher, "_sub", None)
    js, stream, consumer = (getattr(sub, name, None) for name in ("_js", "_stream", "_consumer"))
    if js is None or not stream or not consumer:
        return None
    return js, stream, consumer
