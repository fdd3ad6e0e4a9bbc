"""`fauxmad volume create|list|show|extend|destroy|snapshot|snapshots`: thin; the verbs are the brokers'.

A volume lives on one worker of its region (docs/tutorials/images-and-volumes.md); a machine that mounts it
(`machine run --volume VOL:/path`, or `[[mounts]]` in fauxmad.toml) runs on that worker.
"""

from __future__ import annotations

import re

import typer
from rich import box

from bus.contract.base import VOLUME_ID_PATTERN
from bus.contract.volumes import Volume, VolumeSnapshot
from orchestrator.cli.render import KEYS, FitTable, WideOption, console, print_json
from orchestrator.cli.runtime import (
    JsonOption,
    NatsOption,
    check_app,
    check_region,
    fail,
    with_client,
)

volume_app = typer.Typer(
    help="Volumes: disk of a fixed size on one worker, for the machine that mounts it; snapshots move it.",
    no_args_is_help=True,
)
VOLUME_ID = re.compile(VOLUME_ID_PATTERN)
SNAPSHOT_ID = re.compile(r"^vs_[0-9a-z]{16}$")


def _volume_id(value: str) -> str:
    if not VOLUME_ID.match(value):
        fail(f"invalid volume id {value[:64]!r}: expected vol_ and 16 letters or digits", 2)
    return value


def _snapshot_id(value: str | None) -> str | None:
    if value is not None and not SNAPSHOT_ID.match(value):
        fail(f"invalid snapshot id {value[:64]!r}: expected vs_ and 16 letters or digits", 2)
    return value


AppOption = typer.Option(..., "--app", "-a", help="the app the volume belongs to", callback=check_app)
VolumeArgument = typer.Argument(..., help="volume id (vol_...)", callback=_volume_id)


def _gb(volume: Volume) -> str:
    if not volume.blocks:
        return f"{volume.size_gb} GB"
    used = (volume.blocks - volume.blocks_free) * volume.block_size
    return f"{volume.size_gb} GB ({used / 1e6:.1f} MB used)"


def volumes_table(volumes: list[Volume]) -> FitTable:
    table = FitTable(header_style="bold", box=box.SIMPLE_HEAD, cut_first=("limit", "size", "state"))
    for col in ("id", "name", "region", "worker", "state", "size", "attached", "limit"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for v in volumes:
        table.add_row(
            v.id, v.name, v.region, v.worker_id, v.state, _gb(v), v.attached_machine_id or "-", v.size_limit or "-"
        )
    return table


def snapshots_table(snapshots: list[VolumeSnapshot]) -> FitTable:
    table = FitTable(header_style="bold", box=box.SIMPLE_HEAD, cut_first=("digest", "size", "created"))
    for col in ("id", "volume", "created", "size", "worker", "digest"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for s in snapshots:
        table.add_row(s.id, s.volume_id, s.created_at, f"{s.size / 1e6:.2f} MB", s.worker_id, s.digest[:19])
    return table


def _show(value: Volume | VolumeSnapshot, json_out: bool, line: str) -> None:
    if json_out:
        print_json(value)
    else:
        console.print(line, markup=False, highlight=False)


@volume_app.command("create")
def create(
    name: str = typer.Argument(..., help="the volume's name (letters, digits, - and _)"),
    app: str = AppOption,
    region: str = typer.Option(
        ..., "--region", "-r", help="its region (a worker there gets it)", callback=check_region
    ),
    size_gb: int = typer.Option(1, "--size-gb", "-s", min=1, max=500, help="its size in GB (enforced)"),
    snapshot: str | None = typer.Option(
        None, "--snapshot", help="restore this snapshot (vs_...) into it, from any worker", callback=_snapshot_id
    ),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Create a volume on a worker of the region with room for it (or restore a snapshot into a new one).

    `fauxmad volume create data -a web -r mad --size-gb 1`
    """
    volume = with_client(nats, lambda c: c.volume_create(app, region, name, size_gb, snapshot_id=snapshot))
    restored = f", restored from {snapshot}" if snapshot else ""
    _show(volume, json_out, f"{volume.id} {volume.state} on {volume.worker_id} ({volume.size_gb} GB{restored})")


@volume_app.command("list")
def list_volumes(
    app: str = AppOption,
    all_: bool = typer.Option(False, "--all", help="include destroyed volumes"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """List an app's volumes in every region."""
    volumes = with_client(nats, lambda c: c.volume_list(app, include_destroyed=all_))
    if json_out:
        print_json(volumes)
    elif not volumes:
        console.print(f"no volumes in app {app}")
    else:
        console.print(volumes_table(volumes))


@volume_app.command("show")
def show(
    volume_id: str = VolumeArgument,
    app: str = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """One volume: its worker, state, size and usage, and the machine it is attached to."""
    volume = with_client(nats, lambda c: c.volume_get(app, volume_id))
    if json_out:
        print_json(volume)
    else:
        console.print(volumes_table([volume]))


@volume_app.command("extend")
def extend(
    volume_id: str = VolumeArgument,
    app: str = AppOption,
    size_gb: int = typer.Option(..., "--size-gb", "-s", min=1, max=500, help="the new size in GB (only grows)"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Grow a volume (online: a machine using it keeps running and sees the new size)."""
    volume = with_client(nats, lambda c: c.volume_extend(app, volume_id, size_gb))
    _show(volume, json_out, f"{volume.id} is {volume.size_gb} GB")


@volume_app.command("destroy")
def destroy(
    volume_id: str = VolumeArgument,
    app: str = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Destroy a volume and its data (not one attached to a machine: destroy the machine first)."""
    volume = with_client(nats, lambda c: c.volume_destroy(app, volume_id))
    _show(volume, json_out, f"{volume.id} {volume.state}")


@volume_app.command("snapshot")
def snapshot(
    volume_id: str = VolumeArgument,
    app: str = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Take a snapshot of a volume's files into the fleet's object store (restore: `volume create --snapshot`)."""
    snap = with_client(nats, lambda c: c.volume_snapshot(app, volume_id))
    _show(snap, json_out, f"{snap.id} of {snap.volume_id}: {snap.size / 1e6:.2f} MB {snap.digest}")


@volume_app.command("snapshots")
def snapshots(
    volume_id: str = VolumeArgument,
    app: str = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """List a volume's snapshots."""
    found = with_client(nats, lambda c: c.volume_snapshots(app, volume_id))
    if json_out:
        print_json(found)
    elif not found:
        console.print(f"no snapshots of {volume_id}")
    else:
        console.print(snapshots_table(found))
