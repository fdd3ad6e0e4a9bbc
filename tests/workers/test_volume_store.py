"""Volumes in the worker's store: one op-log record per transition, in the machine's transaction when a machine
attaches or detaches one; the derived table equals a replay of the log, compaction keeps that true; the
lifecycle table refuses illegal transitions; a sandbox binds a volume at its mount path (pure units)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.contract.errors import Conflict
from bus.contract.machines import Guest, Machine, MachineConfig, Mount
from bus.contract.volumes import Volume
from workers.driver.sandbox import bwrap_argv
from workers.log.records import StoredMachine, VolumeRecord
from workers.log.store import Store, Tx
from workers.log.volume_states import VOLUME_LEGAL, check_volume_transition
from workers.volumes.verbs import attach, detach, move

VOL = "vol_0123456789abcdef"


def volume(state: str = "created") -> Volume:
    return Volume(id=VOL, name="data", app="app", region="r", zone="w", state=state, size_gb=1)  # type: ignore[arg-type]


def machine(mounts: list[Mount]) -> StoredMachine:
    return StoredMachine(
        machine=Machine(
            id="0123456789abcd", name="m", app="app", region="r", worker_id="w", state="created",
            config=MachineConfig(cmd=["true"], guest=Guest(), mounts=mounts), instance_id="i",
            created_at="t", updated_at="t",
        )
    )  # fmt: skip


def test_attach_and_detach_commit_with_the_machine_and_replay_equals_the_tables(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    store.write(lambda tx: tx.put_volume(volume(), "create"))
    held = machine([Mount(volume=VOL, path="/data")])

    def reserve(tx: Tx) -> None:
        attach(tx, held.machine)
        tx.put_machine(held, "reserve")

    store.write(reserve)
    attached = store.volume(VOL)
    assert attached is not None and attached.state == "attached" and attached.attached_machine_id == held.machine.id
    records = list(store.log())
    assert [type(r).__name__ for r in records] == ["VolumeRecord", "VolumeRecord", "MachineRecord"]
    with pytest.raises(Conflict, match="attached to machine"):  # a second machine: nothing written
        store.write(lambda tx: attach(tx, machine([Mount(volume=VOL, path="/x")]).machine))
    assert store.log_length() == 3
    store.write(lambda tx: detach(tx, held.machine))
    assert store.volume(VOL).state == "created"  # type: ignore[union-attr]
    assert store.rebuild().volumes == store.snapshot().volumes
    store.write(lambda tx: tx.put_volume(volume("created"), "touch"))
    assert store.compact(keep_last=0, destroyed_retention=0) == 3  # the superseded volume records go
    assert store.rebuild().volumes == store.snapshot().volumes
    last = list(store.log())[-1]
    assert isinstance(last, VolumeRecord) and last.volume.version == last.seq
    store.close()


def test_the_lifecycle_table_refuses_what_it_does_not_list() -> None:
    for current, targets in VOLUME_LEGAL.items():
        for target in VOLUME_LEGAL:
            if target in targets:
                check_volume_transition(VOL, current, target)
            else:
                with pytest.raises(Conflict, match=f"is {current}; it cannot become {target}"):
                    check_volume_transition(VOL, current, target)
    v = volume("destroyed")
    with pytest.raises(Conflict):
        move(v, "attached", 0.0)
    assert v.state == "destroyed"


def test_a_sandbox_binds_each_volume_at_its_path() -> None:
    argv = bwrap_argv("bwrap", ["true"], hostname="m", writable=["/w"], cwd="/w", binds=[("/host/vol", "/data")])
    i = argv.index("/host/vol")
    assert argv[i - 1 : i + 2] == ["--bind", "/host/vol", "/data"]
    assert i < argv.index("--remount-ro")
