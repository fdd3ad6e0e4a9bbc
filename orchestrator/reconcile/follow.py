"""A connected reconciler following the fleet over NATS: its replicas kept current, its loop woken by changes.

`Reconciler.connect` starts one. It starts the observer's replicas (workers, routing index) on their KV
watches, keeps what the apps watch shows in `WatchedReleases` (the operator's fallback while the bucket does
not answer), and wakes the loop on any change: a worker's heartbeat, a machine's event, a new release. An
edge proxy's signal that it could not reach a machine has that machine's worker probed, so a dead host's
spares start without waiting for its heartbeat to expire. It holds the reconciler's NATS connection and
closes it; `over_nats` adapts the same connection to the ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.codec import decoder
from bus.contract.edge import ProxyUnreachable
from bus.transport.election import through_election
from bus.transport.jetstream import FleetKV
from bus.transport.nats_adapter import Nats
from orchestrator.apps.releases import WatchedReleases
from orchestrator.reconcile.observe import Observer

log = logging.getLogger(__name__)


class Following:
    def __init__(self, nc: Nats, observer: Observer, watched: WatchedReleases, wake: Callable[[], None]) -> None:
        self._nc = nc
        self.observer = observer
        self.watched = watched
        self.wake = wake
        self._subs: list[Any] = []
        self._apps_watch: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: set[str] = set()  # workers being probed after an edge proxy's signal

    @classmethod
    async def start(
        cls,
        nc: Nats,
        kv: FleetKV,
        observer: Observer,
        watched: WatchedReleases,
        wake: Callable[[], None],
        *,
        fleet_wide: bool = True,
    ) -> Following:
        """Keep the replicas current and wake the loop on any change: workers, machines, events, releases.
        `fleet_wide=False` (an identity that may subscribe to its own inbox only, a deployer): no events or edge
        proxies' signals, the KV watches (which reply to its inbox) and the loop's poll wake it."""
        following = cls(nc, observer, watched, wake)
        await observer.start(kv)

        async def on_event(msg: Any) -> None:
            wake()

        if fleet_wide:
            following._subs.append(await nc.subscribe(subjects.EVENTS_ALL, cb=on_event))
            following._subs.append(await nc.subscribe(subjects.PROXY_UNREACHABLE_ALL, cb=following._on_proxy_signal))
        following._apps_watch = await through_election(kv.apps.watchall, "the apps bucket's watch")
        following._tasks.append(asyncio.create_task(following._follow_apps()))
        return following

    async def _on_proxy_signal(self, msg: Any) -> None:
        """An edge proxy could not reach a machine: have its worker probed (in a task: callbacks run one
        at a time), at most once per worker at a time."""
        try:
            signal = decoder(ProxyUnreachable).decode(msg.data)
        except msgspec.DecodeError:
            log.info("ignoring a malformed signal on %s", msg.subject)
            return
        if signal.worker_id in self._probing:
            return
        self._probing.add(signal.worker_id)

        async def probe() -> None:
            try:
                if await self.observer.check_host(signal.worker_id, signal.app):
                    log.warning(
                        "worker %s is silent after proxy %s could not reach %s: treating its machines as lost",
                        signal.worker_id,
                        signal.proxy_region or "?",
                        signal.machine_id,
                    )
            finally:
                self._probing.discard(signal.worker_id)

        task = asyncio.create_task(probe())
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _follow_apps(self) -> None:
        async for entry in self._apps_watch:
            if entry is not None:
                self.watched.apply(entry.key, entry.value if entry.operation is None else None)
            self.wake()

    def jetstream(self) -> Any:
        """The JetStream context of the connection."""
        return self._nc.jetstream()

    def closed_for_good(self) -> str | None:
        """Why the connection is closed for good (it reconnects forever otherwise), or None while it is open
        or reconnecting."""
        if not self._nc.is_closed:
            return None
        return f"the NATS connection was closed: {self._nc.last_error or 'by the server'}"

    async def close(self) -> None:
        """Stop following, stop the replicas, close the connection."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._apps_watch is not None:
            with contextlib.suppress(Exception):
                await self._apps_watch.stop()
        for task in list(self._tasks):
            task.cancel()
        await self.observer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.close(), 2.0)
