"""The worker's volume verbs: each one a checked transition, committed to the op log before it is told.

A volume is worker-local (its bytes are on this host, `workers.volumes.storage`), so this worker is its source
of truth, as for its machines. `create` records `creating`, makes the filesystem (and restores a snapshot
into it), then records `created`; `destroy` records `destroying`, removes the data, then `destroyed`. A
worker killed in between finds the intermediate state in the log and `recover` finishes the job before
the worker serves anything. Attaching to a machine happens in that machine's reserve transaction and
detaching in its destroy's (`attach`, `detach`, called by `workers.lifecycle.manager`), so a volume is never held
by two machines and never left held by a machine that is gone.

Snapshots are tars of the volume's files in the object store `fauxmad_volume_snapshots` (its own bucket:
volume data belongs to one app and goes with it, where images are shared, content-addressed and evicted by
other rules); the object is named by the snapshot id and its description holds the `VolumeSnapshot` JSON,
whose `digest` is the archive's sha256. The write is checked: the SHA-256 the store recorded for what it
took must be that digest, or the object is deleted and the snapshot fails. A restore on another worker
refuses an object whose recorded SHA-256 is not the snapshot's before fetching anything, hashes what it
fetches against the digest too, and only then unpacks it into a new volume.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.errors import BadRequest, Conflict, NoCapacity, NotFound
from bus.contract.ids import new_snapshot_id, new_volume_id
from bus.contract.machines import Machine
from bus.contract.volumes import (
    Volume,
    VolumeCreateRequest,
    VolumeExtendRequest,
    VolumeIdRequest,
    VolumeListRequest,
    VolumeSnapshot,
)
from bus.stores.objects import read_chunks, stored_digest
from bus.stores.snapshots import SnapshotMeta, decode_meta
from bus.transport.nats_adapter import JetStream, NotFoundError, ObjectMeta, ObjectNotFoundError, ObjectStore
from workers.log.commit import GroupCommitter
from workers.log.stamps import iso
from workers.log.store import Store, Tx
from workers.log.volume_states import VOLUME_HOLDS, VOLUME_READY, check_volume_transition
from workers.volumes.storage import VolumeFs, VolumeFsError

log = logging.getLogger(__name__)


def move(volume: Volume, to: str, now: float) -> None:
    """Move `volume` to state `to` if the lifecycle table allows it (else 409)."""
    check_volume_transition(volume.id, volume.state, to)
    volume.state = to  # type: ignore[assignment]
    volume.updated_at = iso(now)


def _mode(volume: Volume) -> str:
    """The backend a volume was made with (`workers.volumes.storage`): an ext4 image is a loop mount."""
    return "loop" if volume.size_limit == "loop" else "dir"


def attach(tx: Tx, machine: Machine) -> None:
    """In a machine's reserve transaction: its volumes become `attached` to it, or the reserve fails."""
    for mount in machine.config.mounts:
        volume = tx.volume(mount.volume)
        if volume is None or volume.state == "destroyed":
            raise NotFound(f"volume {mount.volume} not found on worker {machine.worker_id}")
        if volume.app != machine.app:
            raise BadRequest(f"volume {mount.volume} belongs to app {volume.app}, not {machine.app}")
        if volume.state == "attached":
            raise Conflict(f"volume {volume.id} is attached to machine {volume.attached_machine_id}")
        move(volume, "attached", tx.now)
        volume.attached_machine_id, volume.attached_alloc_id = machine.id, machine.instance_id
        tx.put_volume(volume, "attach")


def detach(tx: Tx, machine: Machine) -> None:
    """In a machine's destroy transaction: the volumes it held become `created` (free) again."""
    for mount in machine.config.mounts:
        volume = tx.volume(mount.volume)
        if volume is not None and volume.state == "attached" and volume.attached_machine_id == machine.id:
            move(volume, "created", tx.now)
            volume.attached_machine_id = volume.attached_alloc_id = None
            tx.put_volume(volume, "detach")


class VolumeManager:
    def __init__(
        self,
        *,
        worker_id: str,
        region: str,
        capacity_gb: int,
        store: Store,
        committer: GroupCommitter,
        fs: VolumeFs,
        js: JetStream | None,
        snapshots: ObjectStore | None,
        scratch: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker_id = worker_id
        self.region = region
        self.capacity_gb = capacity_gb
        self.store = store
        self.committer = committer
        self.fs = fs
        self.js = js
        self.snapshots = snapshots
        self.scratch = scratch  # where archives pass through (the worker's data dir: same disk as volumes)
        self.clock = clock
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.on_commit: Callable[[list[Any]], None] = lambda records: None
        self.last_transfer: dict[str, float] = {}  # what the last snapshot or restore moved (bytes, seconds)

    async def _commit(self, fn: Callable[[Tx], Any]) -> Any:
        result, records = await self.committer.submit(fn)
        if records:
            self.on_commit(records)
        return result

    # ------------------------------------------------------------------------------------------
    # reads

    def view(self, volume: Volume) -> Volume:
        out = msgspec.structs.replace(volume)
        if volume.state in VOLUME_READY:
            with contextlib.suppress(OSError):
                out.block_size, out.blocks, out.blocks_free, out.blocks_avail = self.fs.usage(volume.id, _mode(volume))
        return out

    def require(self, volume_id: str) -> Volume:
        volume = self.store.volume(volume_id)
        if volume is None:
            raise NotFound(f"volume {volume_id} not found on worker {self.worker_id}")
        return volume

    def get(self, request: VolumeIdRequest) -> Volume:
        return self.view(self.require(request.id))

    def list(self, request: VolumeListRequest) -> list[Volume]:
        out = [
            self.view(v)
            for v in self.store.volumes()
            if (request.app is None or v.app == request.app) and (request.include_destroyed or v.state != "destroyed")
        ]
        out.sort(key=lambda v: (v.app, v.created_at, v.id))
        return out

    def held_gb(self) -> int:
        return sum(v.size_gb for v in self.store.volumes() if v.state in VOLUME_HOLDS)

    def host_path(self, volume_id: str) -> Path:
        return self.fs.path(volume_id)

    # ------------------------------------------------------------------------------------------
    # create, extend, destroy

    async def create(self, request: VolumeCreateRequest) -> Volume:
        if request.region != self.region:
            raise BadRequest(f"worker {self.worker_id} is in region {self.region}, not {request.region}")
        source = await self._snapshot_info(request.app, request.snapshot_id) if request.snapshot_id else None
        if source is not None and source[0].size_gb > request.size_gb:
            raise BadRequest(
                f"snapshot {request.snapshot_id} is of a {source[0].size_gb} GB volume: size_gb must be at least that"
            )
        volume_id = request.id or new_volume_id()
        mode = await asyncio.to_thread(self.fs.detect)

        def op(tx: Tx) -> tuple[Volume, bool]:
            held = tx.volume(volume_id)
            if held is not None:
                if held.app != request.app or held.name != request.name:
                    raise Conflict(f"volume {volume_id} exists already")
                return held, False  # the same create again (a broker's retry): answer with it
            if tx.worker().cordoned:
                raise NoCapacity(f"worker {self.worker_id} is cordoned")
            used = sum(v.size_gb for v in tx.volumes() if v.state in VOLUME_HOLDS)
            if used + request.size_gb > self.capacity_gb:
                raise NoCapacity(
                    f"worker {self.worker_id} has no room for a {request.size_gb} GB volume: "
                    f"{self.capacity_gb - used} of {self.capacity_gb} GB free"
                )
            stamp = iso(tx.now)
            volume = Volume(
                id=volume_id,
                name=request.name,
                app=request.app,
                region=self.region,
                zone=self.worker_id,
                worker_id=self.worker_id,
                state="creating",
                size_gb=request.size_gb,
                created_at=stamp,
                updated_at=stamp,
                snapshot_id=request.snapshot_id,
                fstype="ext4" if mode == "loop" else "dir",
                size_limit="loop" if mode == "loop" else "none",
            )
            return tx.put_volume(volume, "create"), True

        volume, new = await self._commit(op)
        if not new:
            return self.view(volume)
        async with self._locks[volume_id]:
            return self.view(await self._provision(volume))

    async def _provision(self, volume: Volume) -> Volume:
        """Make a `creating` volume's filesystem (and restore its snapshot), then record `created`.

        Also how `recover` finishes a create cut short: `make` starts over from nothing."""
        try:
            await asyncio.to_thread(self.fs.make, volume.id, volume.size_gb, _mode(volume))
            if volume.snapshot_id:
                await self._restore(volume)
        except (VolumeFsError, NotFound, BadRequest, OSError) as exc:
            log.warning("volume %s: could not be made: %s", volume.id, exc)
            await self._destroy_now(volume.id, reason="create failed")
            if isinstance(exc, NotFound | BadRequest):
                raise
            raise BadRequest(f"volume {volume.id} could not be made on worker {self.worker_id}: {exc}") from None

        def done(tx: Tx) -> Volume:
            current = tx.require_volume(volume.id)
            move(current, "created", tx.now)
            return tx.put_volume(current, "created")

        result: Volume = await self._commit(done)
        return result

    async def extend(self, request: VolumeExtendRequest) -> Volume:
        async with self._locks[request.id]:

            def op(tx: Tx) -> Volume:
                volume = tx.require_volume(request.id)
                if volume.state not in VOLUME_READY:
                    raise Conflict(f"volume {request.id} is {volume.state}; it cannot be extended")
                if request.size_gb <= volume.size_gb:
                    raise BadRequest(
                        f"volume {request.id} is {volume.size_gb} GB: extend only grows it (size_gb > that)"
                    )
                used = sum(v.size_gb for v in tx.volumes() if v.state in VOLUME_HOLDS)
                if used - volume.size_gb + request.size_gb > self.capacity_gb:
                    raise NoCapacity(
                        f"worker {self.worker_id} has no room to extend {request.id} to {request.size_gb} GB"
                    )
                volume.size_gb = request.size_gb
                volume.updated_at = iso(tx.now)
                return tx.put_volume(volume, "extend")

            volume = await self._commit(op)
            # after the commit: a worker killed here finds the new size in the log and `recover` grows it
            in_use = volume.state == "attached"
            if not await asyncio.to_thread(self.fs.extend, volume.id, volume.size_gb, _mode(volume), in_use=in_use):
                log.info("volume %s: grows to %d GB when machine %s starts again", volume.id, volume.size_gb,
                         volume.attached_machine_id)  # fmt: skip
            return self.view(volume)

    async def destroy(self, request: VolumeIdRequest) -> Volume:
        async with self._locks[request.id]:
            volume = self.require(request.id)
            if volume.state == "destroyed":
                return self.view(volume)
            if volume.state == "attached":
                raise Conflict(
                    f"volume {request.id} is attached to machine {volume.attached_machine_id}: destroy it first"
                )
            if volume.state == "creating":
                raise Conflict(f"volume {request.id} is creating; it cannot be destroyed until it is created")
            return self.view(await self._destroy_now(request.id, reason="destroy requested"))

    async def _destroy_now(self, volume_id: str, *, reason: str) -> Volume:
        def mark(tx: Tx) -> Volume:
            volume = tx.require_volume(volume_id)
            if volume.state == "destroying":
                return volume
            move(volume, "destroying", tx.now)
            return tx.put_volume(volume, "destroy")

        await self._commit(mark)
        return await self._finish_destroy(volume_id)

    async def _finish_destroy(self, volume_id: str) -> Volume:
        await asyncio.to_thread(self.fs.remove, volume_id)

        def gone(tx: Tx) -> Volume:
            volume = tx.require_volume(volume_id)
            move(volume, "destroyed", tx.now)
            return tx.put_volume(volume, "destroyed")

        result: Volume = await self._commit(gone)
        return result

    # ------------------------------------------------------------------------------------------
    # after a restart: make the disk agree with the log

    async def recover(self) -> dict[str, int]:
        """Finish every volume transition in flight when the worker stopped; mount the ready ones."""
        counts: dict[str, int] = {}
        for volume in self.store.volumes():
            outcome = "ok"
            try:
                if volume.state == "creating":
                    await self._provision(volume)
                    outcome = "created"
                elif volume.state == "destroying":
                    await self._finish_destroy(volume.id)
                    outcome = "destroyed"
                elif volume.state in VOLUME_READY:
                    offline_ok = volume.state != "attached"  # its machine may be running (re-adopted)
                    await asyncio.to_thread(
                        self.fs.ensure, volume.id, volume.size_gb, _mode(volume), offline_ok=offline_ok
                    )
                    outcome = "mounted"
                else:
                    continue
            except Exception as exc:
                log.error("volume %s: could not be recovered: %s", volume.id, exc)
                outcome = "failed"
            counts[outcome] = counts.get(outcome, 0) + 1
        return counts

    async def ready(self, volume_id: str) -> Path:
        """The host directory of a volume a machine is about to run with (mounted now if it was not)."""
        volume = self.require(volume_id)
        await asyncio.to_thread(self.fs.ensure, volume.id, volume.size_gb, _mode(volume))
        return self.fs.path(volume_id)

    # ------------------------------------------------------------------------------------------
    # snapshots

    def _store(self) -> ObjectStore:
        if self.snapshots is None or self.js is None:
            raise BadRequest(f"worker {self.worker_id} has no snapshot store")
        return self.snapshots

    async def snapshot(self, request: VolumeIdRequest) -> VolumeSnapshot:
        volume = self.require(request.id)
        if volume.state not in VOLUME_READY:
            raise Conflict(f"volume {request.id} is {volume.state}; only a created or attached volume has a snapshot")
        store = self._store()
        snapshot_id = new_snapshot_id()
        archive = self.scratch / f"{snapshot_id}.tar"
        started = time.perf_counter()
        try:
            digest = await asyncio.to_thread(self.fs.archive, volume.id, archive)
            size = archive.stat().st_size
            snap = VolumeSnapshot(
                id=snapshot_id,
                volume_id=volume.id,
                app=volume.app,
                created_at=iso(self.clock()),
                digest=digest,
                size=size,
                region=volume.region,
                worker_id=self.worker_id,
            )
            meta = SnapshotMeta(snapshot=snap, size_gb=volume.size_gb)
            with archive.open("rb") as f:
                info = await store.put(snapshot_id, f, ObjectMeta(description=msgspec.json.encode(meta).decode()))
            if stored_digest(info) != digest or info.size != size:  # the file changed under us
                with contextlib.suppress(ObjectNotFoundError, NotFoundError):
                    await store.delete(snapshot_id)
                raise VolumeFsError(f"the store took {stored_digest(info)}, not the archive's {digest}")
        except VolumeFsError as exc:
            raise BadRequest(f"volume {request.id}: snapshot failed: {exc}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                archive.unlink()
        self.last_transfer = {"bytes": size, "seconds": time.perf_counter() - started}
        log.info(
            "volume %s: snapshot %s, %d bytes in %.2f s", volume.id, snapshot_id, size, time.perf_counter() - started
        )
        return snap

    async def _snapshot_info(self, app: str, snapshot_id: str | None) -> tuple[SnapshotMeta, Any]:
        store = self._store()
        try:
            info = await store.get_info(snapshot_id or "")
        except (ObjectNotFoundError, NotFoundError):
            info = None
        meta = decode_meta(info.description if info is not None else None)
        if info is None or meta is None or meta.snapshot.app != app:
            raise NotFound(f"snapshot {snapshot_id} not found for app {app}")
        if stored_digest(info) != meta.snapshot.digest:
            raise BadRequest(
                f"snapshot {snapshot_id} in the store has digest {stored_digest(info)}, not {meta.snapshot.digest}:"
                " refused (damaged or overwritten)"
            )
        return meta, info

    async def _restore(self, volume: Volume) -> None:
        """Fetch the snapshot to a file (checked against its digest), then unpack it into the volume."""
        meta, info = await self._snapshot_info(volume.app, volume.snapshot_id)
        archive = self.scratch / f"{volume.id}.restore.tar"
        started = time.perf_counter()
        digest = hashlib.sha256()
        try:
            assert self.js is not None
            with archive.open("wb") as f:
                async for chunk in read_chunks(self.js, subjects.SNAPSHOTS_STORE, info):
                    digest.update(chunk)
                    f.write(chunk)
            actual = "sha256:" + digest.hexdigest()
            if actual != meta.snapshot.digest:
                raise BadRequest(
                    f"snapshot {volume.snapshot_id} from the store has digest {actual}, not {meta.snapshot.digest}:"
                    " refused (damaged or overwritten)"
                )
            await asyncio.to_thread(self.fs.restore, volume.id, archive)
        finally:
            with contextlib.suppress(FileNotFoundError):
                archive.unlink()
        seconds = time.perf_counter() - started
        self.last_transfer = {"bytes": meta.snapshot.size, "seconds": seconds}
        log.info(
            "volume %s: restored %s, %d bytes in %.2f s", volume.id, volume.snapshot_id, meta.snapshot.size, seconds
        )
