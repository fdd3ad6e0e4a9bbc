"""One image through every door (issue 25): the CLI's `machine run`, the HTTP API's create (by tag and by
digest, with and without `init.cmd`), a deploy's `image =` and a job (both runners) resolve a reference the
same way, pin the same digest and run the same bytes: the running process prints a file of the image. An
unknown reference is refused at every door; a tampered push changes nothing; a damaged stored object is
replaced by the next good push; a machine whose image cannot be pulled fails loudly (the CLI exits
non-zero with the reason, the API answers 422); a damaged volume snapshot is refused and listed `damaged`.

Real parts: a dev fleet (nats-server with JetStream, worker and broker processes), an API process, the
`fauxmad` CLI as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import ObjectMeta

from bus.contract.machines import Machine
from bus.stores.images import ImageError, Images
from bus.stores.objects import stored_digest
from bus.stores.snapshots import snapshot_store
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.oci import import_layout
from tests import helpers
from tests.helpers import arun, connect_nats, fleet_fixture
from tests.orchestrator.api.test_api import Api, start_api

REGION = "one"
STAMP = "stamp-7f3a"  # what the image's file says: the process prints it, so it ran these bytes
APP_PY = """import http.server, os, sys
stamp = open("stamp.txt").read().strip()
line = f"{stamp} greeting={os.environ.get('GREETING')} cwd={os.path.basename(os.getcwd())}"
print(line, flush=True)
if os.environ.get("FAUXMAD_JOB_ID"):
    sys.exit(0)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = line.encode()
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""
SERVED = f"{STAMP} greeting=hola cwd=srv"


fleet = fleet_fixture(FleetSpec(regions=[REGION], workers_per_region=2, cpus=16, memory_mb=8192))


@pytest.fixture(scope="module")
def api(fleet: DevFleet) -> Iterator[Api]:
    proc, base = start_api(fleet.url)
    yield Api(base)
    proc.terminate()
    proc.wait(10)


def fauxmad(fleet: DevFleet, *args: str) -> subprocess.CompletedProcess[str]:
    return helpers.fauxmad(*args, url=fleet.url, columns=200)


def make_image_dir(directory: Path, stamp: str = STAMP) -> Path:
    (directory / "srv").mkdir(parents=True)
    (directory / "srv" / "app.py").write_text(APP_PY)
    (directory / "srv" / "stamp.txt").write_text(stamp + "\n")
    (directory / "name.txt").write_text(directory.name)  # each test's image its own digest
    return directory


def build(fleet: DevFleet, directory: Path, *args: str) -> str:
    done = fauxmad(fleet, "image", "build", str(directory), *args, "--json")
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["digest"])


APP_IMAGE = ("--cmd", "python3 app.py", "--env", "GREETING=hola", "--workdir", "srv")


def build_app_image(fleet: DevFleet, tmp_path: Path, tag: str) -> str:
    source = make_image_dir(tmp_path / tag.replace(":", "-"))
    digest = build(fleet, source, "--tag", tag, *APP_IMAGE)
    shutil.rmtree(source)  # nothing can come from this host's copy now
    return digest


def with_client(fleet: DevFleet, fn: Any) -> Any:
    async def main() -> Any:
        client = await FleetClient.connect(fleet.url)
        try:
            return await fn(client)
        finally:
            await client.close()

    return arun(main())


def machines_of(fleet: DevFleet, app: str) -> list[Machine]:
    return list(with_client(fleet, lambda c: c.list(app)))


def served(machine: Machine, timeout: float = 15) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{machine.port}/", timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            assert time.monotonic() < deadline, "the machine never answered"
            time.sleep(0.05)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def store_objects(fleet: DevFleet, fn: Any) -> Any:
    async def main() -> Any:
        nc = await connect_nats(fleet.url)
        try:
            return await fn(await Images.open(nc.jetstream()))
        finally:
            await nc.close()

    return arun(main())


# ---------------------------------------------------------------------------------------------------


def test_the_same_image_runs_through_every_door(fleet: DevFleet, api: Api, tmp_path: Path) -> None:
    digest = build_app_image(fleet, tmp_path, "door:v1")

    # the CLI, by tag, no command: the image's own
    run = fauxmad(
        fleet, "machine", "run", "-a", "door-cli", "-r", REGION, "--image", "door:v1", "--wait-up", "0", "--json"
    )
    assert run.returncode == 0, run.stderr
    made = json.loads(run.stdout)
    assert made["config"]["image"] == digest and made["config"]["cmd"] == ["python3", "app.py"]
    (cli_machine,) = machines_of(fleet, "door-cli")
    assert served(cli_machine) == SERVED

    # the HTTP API: by tag with no init (the image's command), by digest with init.cmd (that command)
    status, by_tag = api.call("POST", "/v1/apps/door-api/machines", {"config": {"image": "door:v1"}, "region": REGION})
    assert status == 200, by_tag
    # as Fly answers: `config.image` as the client sent it, `image_ref.digest` what it resolved to (the same)
    assert by_tag["config"]["image"] == "door:v1" and by_tag["image_ref"]["digest"] == digest
    assert by_tag["config"]["init"]["cmd"] == ["python3", "app.py"]
    given = ["sh", "-c", "echo given; exec python3 app.py"]
    body = {"config": {"image": digest, "init": {"cmd": given}}, "region": REGION}
    status, by_digest = api.call("POST", "/v1/apps/door-api/machines", body)
    assert status == 200, by_digest
    assert by_digest["config"]["image"] == digest and by_digest["config"]["init"]["cmd"] == given
    for machine in machines_of(fleet, "door-api"):
        assert machine.config.image == digest and served(machine) == SERVED

    # a deploy: `image =` with no cmd
    spec = tmp_path / "fauxmad.toml"
    spec.write_text(
        f'app = "door-deploy"\nimage = "door:v1"\n[guest]\nmemory_mb = 64\n[regions]\n{REGION} = 1\n[deploy]\nspares = 0\n'
    )
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    (deployed_machine,) = machines_of(fleet, "door-deploy")
    assert deployed_machine.config.image == digest and served(deployed_machine) == SERVED

    # a job as a machine (no command: the image's, which exits when it runs as a job) and as a process
    job = fauxmad(fleet, "job", "submit", "-a", "door-job", "-r", REGION, "--image", "door:v1", "--wait", "--json")
    assert job.returncode == 0, job.stdout + job.stderr
    (as_machine,) = json.loads(job.stdout)
    assert as_machine["image"] == digest and as_machine["cmd"] == ["python3", "app.py"]
    assert as_machine["state"] == "succeeded" and as_machine["stdout"] == SERVED + "\n"
    job = fauxmad(
        fleet, "job", "submit", "-a", "door-job", "-r", REGION, "--image", digest, "--runner", "process",
        "--wait", "--json", "--", "python3", "app.py",
    )  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    (as_process,) = json.loads(job.stdout)
    assert as_process["image"] == digest and as_process["stdout"] == SERVED + "\n"

    # a new image by update: the command that was the old image's becomes the new image's (CLI and API alike)
    v2 = build(fleet, make_image_dir(tmp_path / "door-v2", "stamp-v2"), "--tag", "door:v2", *APP_IMAGE[2:],
               "--cmd", "python3 app.py --v2")  # fmt: skip
    updated = fauxmad(
        fleet, "machine", "update", cli_machine.id, "-a", "door-cli", "--image", "door:v2", "--wait-up", "0", "--json"
    )
    assert updated.returncode == 0, updated.stderr
    assert json.loads(updated.stdout)["config"]["cmd"] == ["python3", "app.py", "--v2"]
    status, moved = api.call("POST", f"/v1/apps/door-api/machines/{by_tag['id']}", {"config": {"image": "door:v2"}})
    assert status == 200 and moved["image_ref"]["digest"] == v2 and moved["config"]["init"]["cmd"][-1] == "--v2", moved
    moved_machines = [m for app in ("door-cli", "door-api") for m in machines_of(fleet, app) if m.config.image == v2]
    assert len(moved_machines) == 2
    assert all(served(machine) == SERVED.replace(STAMP, "stamp-v2") for machine in moved_machines)


def test_an_unknown_reference_is_refused_at_every_door(fleet: DevFleet, api: Api, tmp_path: Path) -> None:
    bare = make_image_dir(tmp_path / "bare")
    bare_digest = build(fleet, bare, "--tag", "bare:v1")  # no --cmd: the image has no command of its own

    for reference, says in (("nosuch:v1", "no image tagged nosuch:v1"), ("nginx", "'nginx' is not a reference")):
        run = fauxmad(fleet, "machine", "run", "-a", "unknown", "-r", REGION, "--image", reference, "--", "true")
        assert run.returncode == 2 and says in one_line(run), run.stderr
        job = fauxmad(fleet, "job", "submit", "-a", "unknown", "-r", REGION, "--image", reference)
        assert job.returncode == 2 and says in one_line(job), job.stderr
    nocmd = fauxmad(fleet, "machine", "run", "-a", "unknown", "-r", REGION, "--image", "bare:v1")
    assert nocmd.returncode == 2 and "bare:v1 has none" in one_line(nocmd)
    neither = fauxmad(fleet, "machine", "run", "-a", "unknown", "-r", REGION)
    assert neither.returncode == 2 and "no command" in one_line(neither)
    job = fauxmad(fleet, "job", "submit", "-a", "unknown", "-r", REGION, "--image", "bare:v1")
    assert job.returncode == 2 and "has no command of its own" in one_line(job)

    missing = "sha256:" + "0" * 64
    cases: list[tuple[dict[str, Any], str]] = [
        ({"image": "nosuch:v1", "init": {"cmd": ["true"]}}, "config.image: no image tagged nosuch:v1"),
        ({"image": missing}, f"config.image: no image {missing}"),
        ({"image": "registry.fly.io/web:deployment-1"}, "config.image: image 'registry.fly.io/web:deployment-1'"),
        ({"image": "bare:v1"}, "config.init.cmd is required: image bare:v1"),
        ({"guest": {"cpus": 1}}, "config.image or config.init.cmd is required"),
    ]
    for config, says in cases:
        status, refused = api.call("POST", "/v1/apps/unknown/machines", {"config": config, "region": REGION})
        assert status == 400 and says in refused["error"], (config, refused)
    status, ran = api.call(
        "POST",
        "/v1/apps/unknown/machines",
        {"config": {"image": "bare:v1", "init": {"exec": ["sleep", "300"]}}, "region": REGION},
    )
    assert status == 200 and ran["image_ref"]["digest"] == bare_digest, ran
    status, refused = api.call("POST", f"/v1/apps/unknown/machines/{ran['id']}", {"config": {"image": "nosuch:v2"}})
    assert status == 400 and "config.image: no image tagged nosuch:v2" in refused["error"]
    assert machines_of(fleet, "unknown") and all(m.config.image == bare_digest for m in machines_of(fleet, "unknown"))

    spec = tmp_path / "fauxmad.toml"
    spec.write_text(f'app = "unknown"\nimage = "nosuch:v1"\n[regions]\n{REGION} = 1\n')
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 2 and "no image tagged nosuch:v1" in deployed.stderr


def test_a_tampered_push_changes_nothing_and_a_good_push_repairs_the_store(fleet: DevFleet, tmp_path: Path) -> None:
    archive = tmp_path / "tam.tgz"
    digest = build(fleet, make_image_dir(tmp_path / "tam"), "--out", str(archive), "--cmd", "python3 app.py")
    tampered = tmp_path / "bad.tgz"
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0x01
    tampered.write_bytes(data)
    tampered.with_name("bad.tgz.json").write_bytes(archive.with_name("tam.tgz.json").read_bytes())

    refused = fauxmad(fleet, "image", "push", str(tampered), "--tag", "tam:v1")
    line = one_line(refused)
    assert refused.returncode == 2 and digest in line and "refused" in line, line
    assert "no image tagged tam:v1" in fauxmad(fleet, "image", "inspect", "tam:v1").stderr
    assert digest not in fauxmad(fleet, "image", "ls", "--json").stdout, "no manifest either"

    pushed = fauxmad(fleet, "image", "push", str(archive), "--tag", "tam:v1")
    assert pushed.returncode == 0, pushed.stderr
    assert json.loads(fauxmad(fleet, "image", "inspect", "tam:v1").stdout)["digest"] == digest

    # the store's object damaged in place: the same size, so only its digest tells; the next push replaces it
    genuine = archive.read_bytes()

    async def damage(images: Images) -> bool:
        await images.store.put(digest, bytes(tampered.read_bytes()))
        return await images.present(digest)

    assert len(tampered.read_bytes()) == len(genuine) and not store_objects(fleet, damage)
    assert fauxmad(fleet, "image", "push", str(archive), "--tag", "tam:v2").returncode == 0

    async def whole(images: Images) -> tuple[bool, bytes]:
        return await images.present(digest), await images.pull(digest)

    present, pulled = store_objects(fleet, whole)
    assert present and pulled == genuine


def test_a_machine_whose_image_cannot_be_pulled_fails_loudly(fleet: DevFleet, api: Api, tmp_path: Path) -> None:
    archive = tmp_path / "dmg.tgz"
    digest = build(fleet, make_image_dir(tmp_path / "dmg"), "--out", str(archive), *APP_IMAGE)
    assert fauxmad(fleet, "image", "push", str(archive), "--tag", "dmg:v1").returncode == 0

    async def damage(images: Images) -> None:
        await images.store.put(digest, b"not the archive that digest names")

    store_objects(fleet, damage)
    refused = "refused (damaged or overwritten)"

    run = fauxmad(fleet, "machine", "run", "-a", "dmg", "-r", REGION, "--image", "dmg:v1", "--wait-up", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    first = run.stderr.strip().splitlines()[0]
    assert "did not start" in first and refused in first and digest in first, run.stderr
    (failed,) = machines_of(fleet, "dmg")
    assert failed.state == "failed"
    start = fauxmad(fleet, "machine", "start", failed.id, "-a", "dmg", "--wait-up", "0")
    assert start.returncode == 1 and refused in start.stderr, start.stderr

    status, answer = api.call("POST", "/v1/apps/dmg-api/machines", {"config": {"image": "dmg:v1"}, "region": REGION})
    assert status == 422 and "failed to start" in answer["error"] and refused in answer["error"], answer
    mid = answer["machine_id"]
    status, got = api.call("GET", f"/v1/apps/dmg-api/machines/{mid}")
    assert status == 200 and got["state"] == "failed" and got["image_ref"]["digest"] == digest
    status, answer = api.call("POST", f"/v1/apps/dmg-api/machines/{mid}/start")
    assert status == 422 and refused in answer["error"] and answer["machine_id"] == mid

    job = fauxmad(
        fleet,
        "job",
        "submit",
        "-a",
        "dmg",
        "-r",
        REGION,
        "--image",
        "dmg:v1",
        "--max-attempts",
        "1",
        "--wait",
        "--json",
    )
    assert job.returncode == 1
    (failed_job,) = json.loads(job.stdout)
    assert failed_job["state"] == "failed" and refused in failed_job["reason"]

    # the genuine push repairs the store: the same machine starts now, and serves the image's file
    assert fauxmad(fleet, "image", "push", str(archive)).returncode == 0
    start = fauxmad(fleet, "machine", "start", failed.id, "-a", "dmg", "--wait-up", "0")
    assert start.returncode == 0, start.stderr
    (machine,) = machines_of(fleet, "dmg")
    assert served(machine) == SERVED


def test_a_damaged_snapshot_is_refused_and_listed_damaged(fleet: DevFleet) -> None:
    async def main(c: FleetClient) -> tuple[str, str]:
        source = await c.volume_create("snapdmg", REGION, "data", 1)
        snap = await c.volume_snapshot("snapdmg", source.id)
        assert [s.status for s in await c.volume_snapshots("snapdmg", source.id)] == ["created"]
        store = await snapshot_store(c.nc.jetstream())
        info = await store.get_info(snap.id)
        assert stored_digest(info) == snap.digest, "the write was checked against the archive's digest"
        await store.put(snap.id, b"other bytes", ObjectMeta(description=info.description))
        listed = await c.volume_snapshots("snapdmg", source.id)
        try:
            await c.volume_create("snapdmg", REGION, "copy", 1, snapshot_id=snap.id)
        except Exception as exc:
            return listed[0].status, str(exc)
        return listed[0].status, "restored"

    status, restore = with_client(fleet, main)
    assert status == "damaged"
    assert "refused (damaged or overwritten)" in restore, restore


def test_stored_digest_and_a_layout_blob_that_is_not_its_name(tmp_path: Path) -> None:
    class Info:
        def __init__(self, digest: str | None) -> None:
            self.digest = digest

    import base64

    raw = hashlib.sha256(b"abc").digest()
    recorded = "SHA-256=" + base64.urlsafe_b64encode(raw).decode()
    assert stored_digest(Info(recorded)) == "sha256:" + raw.hex()  # type: ignore[arg-type]
    assert stored_digest(Info(recorded.rstrip("="))) == "sha256:" + raw.hex()  # type: ignore[arg-type]
    assert stored_digest(Info(None)) is None and stored_digest(Info("MD5=xx")) is None  # type: ignore[arg-type]

    layout = tmp_path / "layout"
    named = hashlib.sha256(b'{"layers": []}').hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "blobs" / "sha256" / named).write_bytes(b'{"layers": [], "x": 1}')  # not what the name says
    (layout / "index.json").write_text(json.dumps({"manifests": [{"digest": f"sha256:{named}"}]}))
    with pytest.raises(ImageError, match="does not hash to its name"):
        import_layout(layout, None)
