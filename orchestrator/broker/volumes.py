"""The brokers' volume verbs (`fauxmad.v1.api.apps.<app>.volumes.<verb>`, docs/tutorials/images-and-volumes.md).

`create` picks a worker of the region with room (the most free volume space by the heartbeats, then the
next on a refusal: a worker's own check in its commit is what counts) and records where the volume went
in KV `fauxmad_volumes`; `list` asks the live workers; `snapshots` reads the snapshot store (a snapshot whose
stored SHA-256 is not its digest is listed `damaged`: a restore would refuse it); the other
verbs go to the volume's worker with the caller's payload, whose answer goes back unchanged. A volume
id the index does not know (a broker that died between the worker's answer and its index write) is
looked for on every live worker, and the index repaired.

It also answers the auction's question for a create that mounts a volume: which worker holds it.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import BadRequest, FauxmadError, NoCapacity, NotFound, Unreachable
from bus.contract.fleet import CreateRequest
from bus.contract.ids import new_volume_id
from bus.contract.verbs import API_VOLUME_REQUESTS, VOLUME_EMPTY_OK
from bus.contract.volumes import (
    Volume,
    VolumeApiCreateRequest,
    VolumeApiListRequest,
    VolumeCreateRequest,
    VolumeIdRequest,
    VolumeIndexEntry,
    VolumeListRequest,
    VolumeSnapshot,
)
from bus.stores.objects import stored_digest
from bus.stores.snapshots import decode_meta
from bus.transport.nats_adapter import KV, KeyNotFoundError, Nats, NotFoundError, ObjectStore
from bus.transport.service import call, request
from orchestrator.replicas.workers import Registry

log = logging.getLogger(__name__)

# a create restores a whole snapshot, and a snapshot uploads one: give them time (their size is the user's)
SLOW_VERBS = {"create": 600.0, "snapshot": 600.0}


class Volumes:
    def __init__(self, nc: Nats, registry: Registry, index: KV, snapshots: ObjectStore) -> None:
        self.nc = nc
        self.registry = registry
        self.index = index
        self.snapshots = snapshots

    async def handle(self, subject: str, data: bytes) -> Any:
        app = subjects.check_token("app", subjects.parse_api_app(subject))
        verb = subjects.parse_verb(subject)
        kind = API_VOLUME_REQUESTS.get(verb)
        if kind is None:
            raise BadRequest(f"unknown verb {verb!r}; expected one of {', '.join(subjects.API_VOLUME_VERBS)}")
        parsed = decode(kind, data, empty_ok=kind in VOLUME_EMPTY_OK)
        if isinstance(parsed, VolumeApiCreateRequest):
            return await self.create(app, parsed)
        if isinstance(parsed, VolumeApiListRequest):
            return await self.list(app, parsed)
        assert isinstance(parsed, VolumeIdRequest) or hasattr(parsed, "id")
        entry = await self.locate(app, parsed.id)  # type: ignore[attr-defined]
        if verb == "snapshots":
            return await self.list_snapshots(app, entry.id)
        reply = await request(
            self.nc, subjects.worker_volumes(entry.worker_id, verb), data, timeout=SLOW_VERBS.get(verb, 30.0)
        )
        return reply.data

    # ------------------------------------------------------------------------------------------
    async def create(self, app: str, req: VolumeApiCreateRequest) -> Volume:
        """On the live, uncordoned worker of the region with the most free volume space that takes it."""
        workers = [w for w in self.registry.workers(req.region) if not w.cordoned]
        workers = [w for w in workers if w.volume_capacity_gb - w.volume_used_gb >= req.size_gb]
        workers.sort(key=lambda w: (-(w.volume_capacity_gb - w.volume_used_gb), w.worker_id))
        if not workers:
            raise NoCapacity(f"no room for a {req.size_gb} GB volume in {req.region} (no live worker has it free)")
        ask = VolumeCreateRequest(
            app=app, region=req.region, name=req.name, size_gb=req.size_gb, id=new_volume_id(),
            snapshot_id=req.snapshot_id,
        )  # fmt: skip
        refusals = []
        for worker in workers:
            try:
                volume = await call(
                    self.nc,
                    subjects.worker_volumes(worker.worker_id, "create"),
                    ask,
                    Volume,
                    timeout=SLOW_VERBS["create"],
                )
            except (NoCapacity, Unreachable) as exc:
                refusals.append(f"{worker.worker_id}: {exc.message}")
                continue
            await self._remember(volume)
            return volume
        raise NoCapacity(f"no room for a {req.size_gb} GB volume in {req.region} ({'; '.join(refusals[:3])})")

    async def _remember(self, volume: Volume) -> None:
        entry = VolumeIndexEntry(
            id=volume.id, app=volume.app, name=volume.name, region=volume.region, worker_id=volume.worker_id
        )
        await self.index.put(volume.id, encode(entry))

    async def locate(self, app: str, volume_id: str) -> VolumeIndexEntry:
        """Which worker holds the volume (404 if none does, or it is another app's)."""
        try:
            found = await self.index.get(volume_id)
            entry = decode(VolumeIndexEntry, found.value) if found is not None and found.value else None
        except (KeyNotFoundError, NotFoundError):
            entry = None
        if entry is None:
            volume = await self._search(volume_id)
            if volume is not None:
                await self._remember(volume)
                entry = VolumeIndexEntry(
                    id=volume.id, app=volume.app, name=volume.name, region=volume.region, worker_id=volume.worker_id
                )
        if entry is None or entry.app != app:
            raise NotFound(f"volume {volume_id} not found in app {app}")
        return entry

    async def _search(self, volume_id: str) -> Volume | None:
        async def ask(worker_id: str) -> Volume | None:
            try:
                return await call(
                    self.nc, subjects.worker_volumes(worker_id, "get"), VolumeIdRequest(id=volume_id), Volume, timeout=3
                )
            except FauxmadError:
                return None

        answers = await asyncio.gather(*[ask(w.worker_id) for w in self.registry.workers()])
        return next((a for a in answers if a is not None), None)

    async def list(self, app: str, req: VolumeApiListRequest) -> builtins.list[Volume]:
        query = VolumeListRequest(app=app, include_destroyed=req.include_destroyed)

        async def ask(worker_id: str) -> builtins.list[Volume]:
            try:
                return await call(
                    self.nc, subjects.worker_volumes(worker_id, "list"), query, builtins.list[Volume], timeout=3
                )
            except FauxmadError as exc:
                log.warning("volume list: worker %s did not answer: %s", worker_id, exc.message)
                return []

        groups = await asyncio.gather(*[ask(w.worker_id) for w in self.registry.workers()])
        volumes = [v for group in groups for v in group]
        volumes.sort(key=lambda v: (v.region, v.created_at, v.id))
        return volumes

    async def list_snapshots(self, app: str, volume_id: str) -> builtins.list[VolumeSnapshot]:
        try:
            infos = await self.snapshots.list()
        except NotFoundError:  # an empty store
            return []
        out = []
        for info in infos:
            meta = decode_meta(info.description)
            if (
                meta is not None
                and not info.deleted
                and meta.snapshot.app == app
                and meta.snapshot.volume_id == volume_id
            ):
                whole = stored_digest(info) == meta.snapshot.digest  # what the store holds is what was taken
                out.append(meta.snapshot if whole else msgspec.structs.replace(meta.snapshot, status="damaged"))
        out.sort(key=lambda s: (s.created_at, s.id))
        return out

    # ------------------------------------------------------------------------------------------
    async def volume_host(self, app: str, req: CreateRequest) -> tuple[str, str] | None:
        """For the auction: (volume id, worker) of the volume a create mounts, or None if it mounts none."""
        if not req.config.mounts:
            return None
        hosts = {}
        for mount in req.config.mounts:
            entry = await self.locate(app, mount.volume)
            if entry.region != req.region:
                raise BadRequest(f"volume {mount.volume} is in region {entry.region}, not {req.region}")
            hosts[entry.worker_id] = mount.volume
        if len(hosts) > 1:
            raise BadRequest(f"the volumes {', '.join(sorted(hosts.values()))} are on different workers")
        worker_id, volume_id = next(iter(hosts.items()))
        return volume_id, worker_id
