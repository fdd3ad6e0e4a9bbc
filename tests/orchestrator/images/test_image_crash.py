"""A worker SIGKILLed while it unpacks an image: its restart pulls the image again, starts the machine
the reserve recorded, and leaves no half-unpacked directory behind. Real nats-server, worker and broker
processes; the kill lands when the worker's `.partial-<pid>` directory appears (mid-unpack)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from bus.contract.errors import FauxmadError
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.stores.images import Images, build_archive, manifest_for
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture

fleet = fleet_fixture(FleetSpec(regions=["crash"], workers_per_region=1, cpus=4, memory_mb=4096))


@pytest.mark.timeout(180)
def test_a_worker_killed_mid_unpack_recovers_the_image_and_the_machine(fleet: DevFleet, tmp_path: Path) -> None:
    source = tmp_path / "big"
    source.mkdir()
    for i in range(40):  # 80 MB in many files: the unpack takes long enough to be caught in the middle
        (source / f"blob{i:02d}").write_bytes(os.urandom(2 << 20))
    data = build_archive(source)
    worker_id = fleet.worker_ids[0]
    images_dir = fleet.root / "workers" / worker_id / "images"

    async def push() -> str:
        nc = await connect_nats(fleet.url)
        try:
            manifest = manifest_for(data, cmd=["sleep", "300"], env={}, workdir="", source="test")
            return (await (await Images.open(nc.jetstream())).push(data, manifest, [])).digest
        finally:
            await nc.close()

    digest = arun(push())
    config = MachineConfig(image=digest, cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))

    async def create_and_kill() -> str | None:
        client = await FleetClient.connect(fleet.url)
        try:
            creating = asyncio.ensure_future(client.create("crashy", CreateRequest(region="crash", config=config)))
            deadline = time.monotonic() + 60
            while not list(images_dir.glob("*.partial-*")):
                assert time.monotonic() < deadline, "the worker never began to unpack"
                assert not creating.done(), "the create finished before the unpack was caught"
                await asyncio.sleep(0.002)
            fleet.kill(f"worker-{worker_id}")
            try:
                return (await creating).id
            except FauxmadError:
                return None  # the worker died before answering: the outcome is the worker's to say
        finally:
            await client.close()

    arun(create_and_kill())
    assert list(images_dir.glob("*.partial-*")), "killed mid-unpack: the partial directory is still there"
    fleet.respawn(f"worker-{worker_id}")

    async def settled() -> list[str]:
        client = await FleetClient.connect(fleet.url)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    found = await client.list("crashy")
                except FauxmadError:
                    found = []
                if found and all(m.state == "started" for m in found):
                    return [m.state for m in found]
                assert time.monotonic() < deadline, [m.state for m in found]
                await asyncio.sleep(0.2)
        finally:
            await client.close()

    assert arun(settled()) == ["started"]
    assert not list(images_dir.glob("*.partial-*")), "the restart removed the half-unpacked directory"
    assert (images_dir / digest.removeprefix("sha256:") / "blob39").stat().st_size == 2 << 20
