"""Volumes end to end (docs/tutorials/images-and-volumes.md): placement on the volume's worker and its own capacity error, the
size enforced, a snapshot restored on another worker with its data intact, illegal transitions 409, a worker
SIGKILLed mid-restore recovering from its log, the CLI as a user runs it.

Real parts: a dev fleet (nats-server with JetStream, two worker processes with data directories of their
own, a broker); the volumes are the workers' own loop-mounted ext4 images (or plain directories where the
host cannot loop-mount: then the size test is skipped, and says why).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bus.contract.errors import Conflict, FauxmadError, NoCapacity
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig, Mount
from bus.contract.volumes import Volume
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT, arun, connect_nats, fleet_fixture

REGION = "vol"
SLEEP = ["sleep", "600"]


fleet = fleet_fixture(FleetSpec(regions=[REGION], workers_per_region=2, cpus=2, memory_mb=2048))


def with_client(fleet: DevFleet, fn):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        client = await FleetClient.connect(fleet.url)
        try:
            return await fn(client)
        finally:
            await client.close()

    return arun(main())


def mounted(volume: Volume, path: str = "/data", cpus: int = 1, cmd: list[str] = SLEEP) -> MachineConfig:
    return MachineConfig(cmd=cmd, guest=Guest(cpus=cpus, memory_mb=64), mounts=[Mount(volume=volume.id, path=path)])


def host_dir(fleet: DevFleet, volume: Volume) -> Path:
    return fleet.root / "workers" / volume.worker_id / "volumes" / volume.id


def other(fleet: DevFleet, worker_id: str) -> str:
    return next(w for w in fleet.worker_ids if w != worker_id)


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_machine_mounting_a_volume_lands_on_its_worker_and_gets_the_volume_hosts_capacity_error(
    fleet: DevFleet,
) -> None:
    async def main(c: FleetClient) -> None:
        volume = await c.volume_create("place", REGION, "data", 1)
        assert volume.state == "created" and volume.worker_id in fleet.worker_ids
        away = other(fleet, volume.worker_id)
        for _ in range(3):  # whichever worker has more room otherwise, the machine goes where its volume is
            m = await c.create("place", CreateRequest(region=REGION, config=mounted(volume), explain=True))
            assert m.worker_id == volume.worker_id
            rejected = {w["worker_id"]: w for w in m.explain["workers"] if w["outcome"] == "rejected"}
            assert rejected[away]["filter"] == "volume", m.explain
            assert (await c.volume_get("place", volume.id)).attached_machine_id == m.id
            with pytest.raises(Conflict, match="attached to machine"):  # one machine at a time
                await c.create("place", CreateRequest(region=REGION, config=mounted(volume)))
            await c.destroy("place", m.id, force=True)
            assert (await c.volume_get("place", volume.id)).state == "created"  # detached with the machine
        # fill the volume's host (the other worker keeps room): its own error, not "no capacity in the region"
        filler = await c.create(
            "place",
            CreateRequest(
                region=REGION,
                config=MachineConfig(cmd=SLEEP, guest=Guest(cpus=2, memory_mb=64)),
                avoid_workers=[away],
            ),
        )
        assert filler.worker_id == volume.worker_id
        with pytest.raises(NoCapacity, match="no room on the volume's host") as refused:
            await c.create("place", CreateRequest(region=REGION, config=mounted(volume)))
        assert volume.worker_id in refused.value.message and "insufficient cpus" in refused.value.message
        assert (await c.volume_get("place", volume.id)).state == "created"  # nothing was attached
        await c.destroy("place", filler.id, force=True)

    with_client(fleet, main)


def test_the_size_is_enforced_and_extend_grows_it_online(fleet: DevFleet) -> None:
    async def main(c: FleetClient) -> None:
        volume = await c.volume_create("size", REGION, "data", 1)
        if volume.size_limit != "loop":
            pytest.skip("this host cannot loop-mount an ext4 image: volumes are plain directories, size not enforced")
        m = await c.create("size", CreateRequest(region=REGION, config=mounted(volume)))
        put = 'fallocate -l "$1" "$FAUXMAD_VOLUME_PATH/$2" && df -k "$FAUXMAD_VOLUME_PATH" | tail -1'
        fits = await c.exec("size", m.id, ["sh", "-c", put, "sh", "600M", "a"])
        assert fits.exit_code == 0, fits.stderr
        over = await c.exec("size", m.id, ["sh", "-c", put, "sh", "600M", "b"])  # 1.2 GB in a 1 GB volume
        assert over.exit_code != 0 and "No space left on device" in over.stderr, over
        grown = await c.volume_extend("size", volume.id, 2)  # while the machine runs
        assert grown.size_gb == 2
        restarted = grown.blocks * grown.block_size < 1.8e9
        if restarted:  # the kernel refused an online resize: at the next start
            await c.stop("size", m.id)
            await c.start("size", m.id)
            await c.wait("size", m.id, "started", timeout=30)
        now = await c.volume_get("size", volume.id)
        assert now.blocks * now.block_size > 1.8e9, (f"restarted: {restarted}", grown.blocks, now)
        again = await c.exec("size", m.id, ["sh", "-c", put, "sh", "600M", "b"])
        assert again.exit_code == 0, again.stderr
        with pytest.raises(FauxmadError, match="only grows"):
            await c.volume_extend("size", volume.id, 1)
        await c.destroy("size", m.id, force=True)
        await c.volume_destroy("size", volume.id)

    with_client(fleet, main)


def test_a_snapshot_restores_on_another_worker_with_its_data_intact(fleet: DevFleet) -> None:
    async def main(c: FleetClient) -> tuple[Volume, Volume]:
        source = await c.volume_create("snap", REGION, "data", 1)
        root = host_dir(fleet, source)
        (root / "deep" / "er").mkdir(parents=True)
        (root / "deep" / "er" / "blob").write_bytes(os.urandom(8 << 20))
        (root / "notes.txt").write_text("kept across hosts\n")
        os.symlink("notes.txt", root / "link")
        snap = await c.volume_snapshot("snap", source.id)
        assert snap.volume_id == source.id and snap.digest.startswith("sha256:") and snap.size > 8 << 20
        assert [s.id for s in await c.volume_snapshots("snap", source.id)] == [snap.id]
        # the source's worker holds 1 GB more: the restore goes to the other one
        restored = await c.volume_create("snap", REGION, "copy", 1, snapshot_id=snap.id)
        assert restored.worker_id != source.worker_id and restored.snapshot_id == snap.id
        # a machine mounting the copy runs on the copy's worker and reads the data there
        m = await c.create("snap", CreateRequest(region=REGION, config=mounted(restored)))
        assert m.worker_id == restored.worker_id
        read = await c.exec("snap", m.id, ["sh", "-c", 'cat "$FAUXMAD_VOLUME_PATH/link"'])
        assert read.stdout == "kept across hosts\n"
        await c.destroy("snap", m.id, force=True)
        return source, restored

    source, restored = with_client(fleet, main)
    assert tree_digest(host_dir(fleet, restored)) == tree_digest(host_dir(fleet, source))
    assert os.readlink(host_dir(fleet, restored) / "link") == "notes.txt"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_sandboxed_machine_sees_its_volume_at_its_path(fleet: DevFleet) -> None:
    async def main(c: FleetClient) -> tuple[Volume, str]:
        volume = await c.volume_create("boxed", REGION, "data", 1)
        config = msgspec.structs.replace(
            mounted(volume, path="/srv/data"), guest=Guest(cpus=1, memory_mb=64, sandbox="bwrap")
        )
        m = await c.create("boxed", CreateRequest(region=REGION, config=config))
        script = 'echo written-inside > /srv/data/f && echo "$FAUXMAD_VOLUME_PATH" && ls /srv'
        out = await c.exec("boxed", m.id, ["sh", "-c", script])
        await c.destroy("boxed", m.id, force=True)
        return volume, out.stdout + out.stderr

    volume, stdout = with_client(fleet, main)
    assert stdout == "/srv/data\ndata\n"
    assert (host_dir(fleet, volume) / "f").read_text() == "written-inside\n"


def test_illegal_transitions_are_409_on_the_worker_and_through_the_brokers(fleet: DevFleet) -> None:
    async def main(c: FleetClient) -> None:
        volume = await c.volume_create("rules", REGION, "data", 1)
        m = await c.create("rules", CreateRequest(region=REGION, config=mounted(volume)))
        with pytest.raises(Conflict, match="attached to machine"):
            await c.volume_destroy("rules", volume.id)
        await c.destroy("rules", m.id, force=True)
        gone = await c.volume_destroy("rules", volume.id)
        assert gone.state == "destroyed" and not host_dir(fleet, volume).exists()
        assert (await c.volume_destroy("rules", volume.id)).state == "destroyed"  # again: already done
        with pytest.raises(Conflict, match="destroyed; it cannot be extended"):
            await c.volume_extend("rules", volume.id, 2)
        with pytest.raises(Conflict, match="only a created or attached volume"):
            await c.volume_snapshot("rules", volume.id)
        with pytest.raises(FauxmadError) as not_found:  # a destroyed volume attaches to nothing
            await c.create("rules", CreateRequest(region=REGION, config=mounted(volume)))
        assert not_found.value.code == 404
        # raw, as another service speaks the worker's subject: the code is in the headers
        nc = await connect_nats(fleet.url)
        try:
            subject = f"fauxmad.v1.worker.{volume.worker_id}.volumes.extend"
            reply = await nc.request(subject, json.dumps({"id": volume.id, "size_gb": 3}).encode(), timeout=5)
            assert reply.headers["Nats-Service-Error-Code"] == "409"
            bad = await nc.request(subject, b'{"id": "vol_x", "size_gb": 3}', timeout=5)
            assert bad.headers["Nats-Service-Error-Code"] == "400"
        finally:
            await nc.close()
        # another app's volume is not found (nor mountable)
        with pytest.raises(FauxmadError) as foreign:
            await c.volume_get("other-app", volume.id)
        assert foreign.value.code == 404

    with_client(fleet, main)


@pytest.mark.timeout(240)
def test_a_worker_killed_mid_restore_finishes_it_from_its_log(fleet: DevFleet) -> None:
    async def prepare(c: FleetClient) -> tuple[Volume, str]:
        source = await c.volume_create("crash", REGION, "data", 2)
        root = host_dir(fleet, source)
        for i in range(12):  # 240 MB: the restore takes long enough to be caught in the middle
            (root / f"blob{i:02d}").write_bytes(os.urandom(20 << 20))
        return source, (await c.volume_snapshot("crash", source.id)).id

    source, snapshot_id = with_client(fleet, prepare)
    target = other(fleet, source.worker_id)
    scratch = fleet.root / "workers" / target
    volume_id = "vol_crash0restore001"

    async def create_and_kill() -> None:
        nc = await connect_nats(fleet.url)
        try:
            ask = {"app": "crash", "region": REGION, "name": "copy", "size_gb": 2, "id": volume_id,
                   "snapshot_id": snapshot_id}  # fmt: skip
            subject = f"fauxmad.v1.worker.{target}.volumes.create"
            creating = asyncio.ensure_future(nc.request(subject, json.dumps(ask).encode(), timeout=120))
            partial = scratch / f"{volume_id}.restore.tar"
            deadline = time.monotonic() + 60
            while not (partial.exists() and partial.stat().st_size > 20 << 20):
                assert time.monotonic() < deadline, "the worker never began to fetch the snapshot"
                assert not creating.done(), "the restore finished before it was caught"
                await asyncio.sleep(0.002)
            fleet.kill(f"worker-{target}")
            creating.cancel()
        finally:
            await nc.close()

    arun(create_and_kill())
    fleet.respawn(f"worker-{target}")

    async def settled() -> Volume:
        nc = await connect_nats(fleet.url)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    msg = await nc.request(
                        f"fauxmad.v1.worker.{target}.volumes.get", json.dumps({"id": volume_id}).encode(), timeout=2
                    )
                    got = msgspec.json.decode(msg.data, type=Volume)
                    if got.state == "created":
                        return got
                except Exception:
                    pass
                assert time.monotonic() < deadline, "the restarted worker never finished the restore"
                await asyncio.sleep(0.2)
        finally:
            await nc.close()

    restored = arun(settled())
    assert restored.worker_id == target
    assert tree_digest(host_dir(fleet, restored)) == tree_digest(host_dir(fleet, source))
    assert not (scratch / f"{volume_id}.restore.tar").exists()


def test_the_cli_creates_lists_and_refuses_bad_input(fleet: DevFleet) -> None:
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT), COLUMNS="200")

    def fauxmad(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, env=env, timeout=120
        )

    made = fauxmad("volume", "create", "data", "-a", "clivol", "-r", REGION, "--size-gb", "1", "--json")
    assert made.returncode == 0, made.stderr
    volume = json.loads(made.stdout)
    listed = fauxmad("volume", "list", "-a", "clivol")
    assert volume["id"] in listed.stdout and "created" in listed.stdout
    shown = json.loads(fauxmad("volume", "show", volume["id"], "-a", "clivol", "--json").stdout)
    assert shown["worker_id"] == volume["worker_id"]
    run = fauxmad("machine", "run", "-a", "clivol", "-r", REGION, "--volume", f"{volume['id']}:/data", "--json",
                  "--", "sh", "-c", 'echo up > "$FAUXMAD_VOLUME_PATH/up"; exec sleep 600')  # fmt: skip
    assert run.returncode == 0, run.stderr
    busy = fauxmad("volume", "destroy", volume["id"], "-a", "clivol")
    assert busy.returncode == 5 and "attached" in busy.stderr and "Traceback" not in busy.stderr
    bad = fauxmad("volume", "show", "nope", "-a", "clivol")
    assert bad.returncode == 2 and "invalid volume id" in bad.stderr and "Traceback" not in bad.stderr
    missing = fauxmad("volume", "show", "vol_0000000000000000", "-a", "clivol")
    assert missing.returncode == 4, missing.stderr
    machine = json.loads(run.stdout)
    assert fauxmad("machine", "destroy", machine["id"], "-a", "clivol", "--force").returncode == 0
    assert fauxmad("volume", "destroy", volume["id"], "-a", "clivol").returncode == 0


def test_readme_volumes_block_runs_verbatim(fleet: DevFleet) -> None:
    text = (ROOT / "docs" / "tutorials" / "images-and-volumes.md").read_text()
    section = text.split("## Volumes", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT), COLUMNS="200")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.replace("--region mad", f"--region {REGION}")],
        capture_output=True, text=True, env=env, timeout=180, cwd=str(ROOT),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_http_api_speaks_fly_volumes(fleet: DevFleet) -> None:
    import urllib.error
    import urllib.request

    from tests.orchestrator.api.test_api import start_api

    proc, base = start_api(fleet.url)

    def call(method: str, path: str, payload: object | None = None) -> tuple[int, object]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            base + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    try:
        # what flyctl sends, fields fauxmad does not act on included
        status, volume = call("POST", "/v1/apps/httpvol/volumes", {
            "name": "data", "region": REGION, "size_gb": 1, "encrypted": True, "require_unique_zone": False,
            "snapshot_retention": 5, "fstype": "ext4"})  # fmt: skip
        assert status == 200, volume
        assert isinstance(volume, dict) and volume["state"] == "created" and volume["size_gb"] == 1
        vid = volume["id"]
        assert call("GET", f"/v1/apps/httpvol/volumes/{vid}")[1]["zone"] == volume["worker_id"]  # type: ignore[index]
        assert [v["id"] for v in call("GET", "/v1/apps/httpvol/volumes")[1]] == [vid]  # type: ignore[union-attr]
        status, machine = call("POST", "/v1/apps/httpvol/machines", {
            "region": REGION, "config": {"init": {"exec": ["sleep", "600"]}, "guest": {"cpus": 1, "memory_mb": 64},
                                         "mounts": [{"volume": vid, "path": "/data"}]}})  # fmt: skip
        assert status == 200, machine
        assert machine["worker_id"] == volume["worker_id"]  # type: ignore[index]
        assert machine["config"]["mounts"] == [{"volume": vid, "path": "/data"}]  # type: ignore[index]
        status, busy = call("DELETE", f"/v1/apps/httpvol/volumes/{vid}")
        assert status == 409 and "attached" in busy["error"], busy  # type: ignore[index]
        status, extended = call("PUT", f"/v1/apps/httpvol/volumes/{vid}/extend", {"size_gb": 2})
        assert status == 200 and extended["volume"]["size_gb"] == 2, extended  # type: ignore[index]
        assert isinstance(extended["needs_restart"], bool)  # type: ignore[index]
        status, snap = call("POST", f"/v1/apps/httpvol/volumes/{vid}/snapshots")
        assert status == 200 and snap["volume_id"] == vid, snap  # type: ignore[index]
        listed = call("GET", f"/v1/apps/httpvol/volumes/{vid}/snapshots")[1]
        assert [s["id"] for s in listed] == [snap["id"]]  # type: ignore[index, union-attr]
        assert call("GET", "/v1/apps/httpvol/volumes/vol_nope")[0] == 404
        assert call("POST", "/v1/apps/httpvol/volumes", {"name": "x", "region": REGION, "size_gb": 0})[0] == 400
        status, full = call("POST", "/v1/apps/httpvol/volumes", {"name": "x", "region": "nowhere"})
        assert status == 503 and full["status"] == "insufficient_capacity"  # type: ignore[index]
        assert call("DELETE", f"/v1/apps/httpvol/machines/{machine['id']}?force=true")[0] == 200  # type: ignore[index]
        status, gone = call("DELETE", f"/v1/apps/httpvol/volumes/{vid}")
        assert status == 200 and gone["state"] == "destroyed"  # type: ignore[index]
    finally:
        proc.terminate()
        proc.wait(10)


def test_malformed_volume_requests_get_4xx_and_change_nothing(fleet: DevFleet) -> None:
    from bus.contract.verbs import API_VOLUME_REQUESTS, WORKER_VOLUME_REQUESTS

    bad = [
        b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"id": 5}', b'{"id": "vol_0123456789abcdef", "nope": 1}',
        b'{"id": "' + b"v" * 100_000 + b'"}', b'{"id": "vol_0123456789abcdef", "size_gb": -1}',
        b'{"id": "vol_0123456789abcdef", "size_gb": 1e308}', b'{"region": "a.b", "name": "x"}',
        b'{"app": "a", "region": "r", "name": "../../etc", "size_gb": 1}', b'{"snapshot_id": "vs_../../x"}',
    ]  # fmt: skip

    async def main(c: FleetClient) -> None:
        before = await c.volume_list("fuzz", include_destroyed=True)
        nc = await connect_nats(fleet.url)
        try:
            targets = [(f"fauxmad.v1.worker.{fleet.worker_ids[0]}.volumes.{v}", v) for v in WORKER_VOLUME_REQUESTS]
            targets += [(f"fauxmad.v1.api.apps.fuzz.volumes.{v}", v) for v in API_VOLUME_REQUESTS]
            targets += [(f"fauxmad.v1.worker.{fleet.worker_ids[0]}.volumes.nosuchverb", "?")]
            for subject, verb in targets:
                for payload in bad:
                    reply = await nc.request(subject, payload, timeout=10)
                    code = int((reply.headers or {}).get("Nats-Service-Error-Code", 200))
                    if verb == "list" and code == 200:
                        continue  # `null`/`{}`-like bodies of a list are an empty query
                    assert 400 <= code < 500, (subject, payload[:80], code, reply.data[:200])
        finally:
            await nc.close()
        assert await c.volume_list("fuzz", include_destroyed=True) == before == []

    with_client(fleet, main)
