"""Volumes (an addition; docs/tutorials/images-and-volumes.md): flyd's other state machine, with Fly's field names,
and their snapshots. A volume lives on one worker, and a machine that mounts it can only be placed on that worker.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from bus.contract.base import Name, Reply, Request, SnapshotId, Token, VolumeId

SizeGb = Annotated[int, msgspec.Meta(ge=1, le=500)]  # Fly's largest volume


VolumeState = Literal["creating", "created", "attached", "destroying", "destroyed"]


class Volume(Reply):
    id: str
    name: str
    app: str
    region: str
    zone: str  # Fly's zone is the host's; here the worker's id (a volume never leaves its worker)
    state: VolumeState
    size_gb: int
    attached_machine_id: str | None = None
    attached_alloc_id: str | None = None  # the attached machine's instance id
    created_at: str = ""
    encrypted: bool = False
    fstype: str = "ext4"
    block_size: int = 0
    blocks: int = 0
    blocks_avail: int = 0
    blocks_free: int = 0
    snapshot_retention: int = 5
    auto_backup_enabled: bool = False
    # additions
    worker_id: str = ""
    updated_at: str = ""
    size_limit: str = ""  # how the size is enforced on this worker: "loop" (an ext4 image) or "none"
    snapshot_id: str | None = None  # the snapshot it was restored from
    version: int = 0  # the worker's log sequence of the last change


class VolumeSnapshot(Reply):
    id: str
    volume_id: str
    app: str
    created_at: str
    digest: str  # sha256:<hex> of the archive
    size: int  # bytes of the archive in the object store
    status: str = "created"
    region: str = ""
    worker_id: str = ""  # where it was taken


class VolumeIndexEntry(Reply):
    """A value of KV `fauxmad_volumes` (key: the volume id): where a volume lives, for routing by id."""

    id: str
    app: str
    name: str
    region: str
    worker_id: str  # a volume never moves: this is written once, by the broker that created it


class VolumeCreateRequest(Request):
    """Create a volume on this worker (`worker.<id>.volumes.create`), empty or restored from a snapshot."""

    app: Token
    region: Token
    name: Name
    size_gb: SizeGb = 1
    id: VolumeId | None = None  # the broker's choice, so a re-sent create names the same volume
    snapshot_id: SnapshotId | None = None


class VolumeIdRequest(Request):
    id: VolumeId


class VolumeExtendRequest(Request):
    id: VolumeId
    size_gb: SizeGb


class VolumeListRequest(Request):
    app: Token | None = None
    include_destroyed: bool = False


class VolumeApiCreateRequest(Request):
    """`api.apps.<app>.volumes.create`: the brokers pick a worker of the region with room for it."""

    region: Token
    name: Name
    size_gb: SizeGb = 1
    snapshot_id: SnapshotId | None = None


class VolumeApiListRequest(Request):
    include_destroyed: bool = False
