"""The worker's endpoints: (subject, data) -> reply Struct, for the `Responder` to answer.

The auction's offers, the machine and volume verbs (looked up in `workers.agent.routes`, decoded with
the contract's type, counted in the request metrics), `info`, `cordon` and `uncordon`. NATS types stop
at the `Responder`: nothing here sees a message.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import BadRequest, FauxmadError
from bus.contract.fleet import CordonRequest, InfoRequest, WorkerInfo
from bus.contract.offers import OfferRequest
from bus.contract.verbs import EMPTY_OK, VOLUME_EMPTY_OK
from workers import metrics
from workers.agent.routes import machine_routes, volume_routes
from workers.lifecycle.manager import MachineManager
from workers.log.commit import GroupCommitter
from workers.log.records import WorkerState
from workers.offers import Backpressure, Snapshot, answer_offer
from workers.output import LogFollower
from workers.volumes.verbs import VolumeManager


class Handlers:
    def __init__(
        self,
        *,
        manager: MachineManager,
        volumes: VolumeManager,
        follower: LogFollower,
        committer: GroupCommitter,
        backpressure: Backpressure,
        snapshot: Callable[[], Snapshot],
        state: Callable[[], Hashable],
        info: Callable[[], WorkerInfo],
        put_heartbeat: Callable[[WorkerInfo], Awaitable[None]],
        routed: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.machine_routes = machine_routes(manager, follower, routed)
        self.volume_routes = volume_routes(volumes)
        self.committer = committer
        self.backpressure = backpressure
        self.snapshot = snapshot
        self.state = state  # changes whenever anything the snapshot holds may have
        self._offer_key: tuple[bytes, Hashable] | None = None
        self._offer = b""
        self.info = info
        self.put_heartbeat = put_heartbeat

    async def on_offer(self, subject: str, data: bytes) -> Any:
        return self.offer(subject, data)

    def offer(self, subject: str, data: bytes) -> bytes:
        """The auction's question answered, encoded. Every worker of the region answers every scatter, most
        with nothing changed since the last one: while the question's bytes and the worker's state (`state`:
        read before the snapshot, so a change after it is a new key) are the same, the last answer goes again."""
        key = (data, self.state())
        if key == self._offer_key:
            return self._offer
        request = decode(OfferRequest, data)
        body = encode(answer_offer(request, self.snapshot(), self.backpressure))
        self._offer_key, self._offer = key, body
        return body

    async def on_machines(self, subject: str, data: bytes) -> Any:
        verb = subjects.parse_verb(subject)
        route = self.machine_routes.get(verb)
        if route is None:
            raise BadRequest(f"unknown verb {verb!r}; expected one of {', '.join(subjects.WORKER_VERBS)}")
        request = decode(route.kind, data, empty_ok=route.kind in EMPTY_OK)
        started = time.perf_counter()
        try:
            result = await route.call(request)
        except FauxmadError as exc:
            metrics.REQUESTS.labels(verb, str(exc.code)).inc()
            raise
        metrics.REQUESTS.labels(verb, "ok").inc()
        metrics.REQUEST_SECONDS.labels(verb).observe(time.perf_counter() - started)
        return result

    async def on_volumes(self, subject: str, data: bytes) -> Any:
        verb = subjects.parse_verb(subject)
        route = self.volume_routes.get(verb)
        if route is None:
            raise BadRequest(f"unknown verb {verb!r}; expected one of {', '.join(subjects.WORKER_VOLUME_VERBS)}")
        request = decode(route.kind, data, empty_ok=route.kind in VOLUME_EMPTY_OK)
        return await route.call(request)

    async def on_info(self, subject: str, data: bytes) -> Any:
        decode(InfoRequest, data, empty_ok=True)
        return self.info()

    async def on_cordon(self, subject: str, data: bytes) -> Any:
        request = decode(CordonRequest, data, empty_ok=True)
        cordon = subjects.parse_verb(subject) == "cordon"

        def op(tx: Any) -> None:
            current = tx.worker()
            if current.cordoned != cordon or current.reason != request.reason:
                tx.put_worker(WorkerState(cordoned=cordon, reason=request.reason), "cordon" if cordon else "uncordon")

        await self.committer.submit(op)
        info = self.info()
        await self.put_heartbeat(info)
        return info
