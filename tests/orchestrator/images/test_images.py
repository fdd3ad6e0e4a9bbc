"""Images end to end: a directory built into an image, pushed to the fleet's store, pulled by workers that
never saw it (the directory is deleted before anything runs), deployed by tag and by `build = "."`; a
damaged object in the store is refused; a burst of creates pulls a cold image once per worker.

Real parts: a dev fleet (nats-server with JetStream, worker and broker processes with data directories of
their own), the `fauxmad` CLI as a user runs it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import pytest

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.stores.images import Images
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests import helpers
from tests.helpers import ROOT, arun, connect_nats, fleet_fixture

APP_PY = """import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open("message.txt", "rb").read()
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""


fleet = fleet_fixture(FleetSpec(regions=["img"], workers_per_region=2, cpus=16, memory_mb=8192))


def fauxmad(fleet: DevFleet, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return helpers.fauxmad(*args, url=fleet.url, columns=200, cwd=cwd)


def make_app(directory: Path, message: str) -> Path:
    directory.mkdir(parents=True)
    (directory / "app.py").write_text(APP_PY)
    (directory / "message.txt").write_text(message)
    return directory


def served(machine: Machine) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{machine.port}/", timeout=5) as response:
        return str(response.read().decode())


def machines_of(fleet: DevFleet, app: str) -> list[Machine]:
    async def main() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return await client.list(app)
        finally:
            await client.close()

    return arun(main())


def wait_served(machine: Machine, timeout: float = 15) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return served(machine)
        except OSError:
            assert time.monotonic() < deadline, "the machine never answered"
            time.sleep(0.05)


def test_a_built_image_runs_on_workers_that_never_saw_its_directory(fleet: DevFleet, tmp_path: Path) -> None:
    source = make_app(tmp_path / "hello", "hello from the image")
    built = fauxmad(fleet, "image", "build", str(source), "--tag", "hello:v1", "--cmd", "python3 app.py", "--json")
    assert built.returncode == 0, built.stderr
    digest = json.loads(built.stdout)["digest"]
    again = fauxmad(fleet, "image", "build", str(source), "--out", str(tmp_path / "again.tgz"), "--json")
    assert json.loads(again.stdout)["digest"] == digest, "the same tree gives the same digest"
    shutil.rmtree(source)  # nothing can come from this host's copy now

    spec = tmp_path / "deploy" / "fauxmad.toml"
    spec.parent.mkdir()
    spec.write_text(
        'app = "hello"\nimage = "hello:v1"\n[guest]\nmemory_mb = 64\n[regions]\nimg = 2\n[deploy]\nspares = 0\n'
    )
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    found = machines_of(fleet, "hello")
    assert len(found) == 2 and {m.config.image for m in found} == {digest}, "the release pins the digest"
    assert len({m.worker_id for m in found}) == 2
    for machine in found:
        assert wait_served(machine) == "hello from the image"
    listed = json.loads(fauxmad(fleet, "image", "ls", "--json").stdout)
    assert any(m["digest"] == digest and "hello:v1" in m["tags"] for m in listed)
    inspected = fauxmad(fleet, "image", "inspect", "hello:v1")
    assert json.loads(inspected.stdout)["cmd"] == ["python3", "app.py"]
    missing = fauxmad(fleet, "image", "inspect", "nosuch:v9")
    assert (
        missing.returncode != 0 and "no image tagged nosuch:v9" in missing.stderr and "Traceback" not in missing.stderr
    )


def test_build_dot_deploys_the_spec_directory_and_pins_it(fleet: DevFleet, tmp_path: Path) -> None:
    app_dir = make_app(tmp_path / "site", "built from the spec's directory")
    (app_dir / "fauxmad.toml").write_text(
        'app = "site"\nbuild = "."\ncmd = ["python3", "app.py"]\n[guest]\nmemory_mb = 64\n[regions]\nimg = 1\n'
        "[deploy]\nspares = 0\n"
    )
    deployed = fauxmad(fleet, "deploy", cwd=app_dir)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "built " in deployed.stdout and "sha256:" in deployed.stdout
    (machine,) = machines_of(fleet, "site")
    assert machine.config.image is not None and machine.config.image.startswith("sha256:")
    assert wait_served(machine) == "built from the spec's directory"
    # the release keeps the digest (not the directory): what a rollback restores
    releases = json.loads(fauxmad(fleet, "releases", "-a", "site", "--json").stdout)["releases"]
    assert releases[-1]["spec"]["image"] == machine.config.image and releases[-1]["spec"].get("build") is None


def test_a_damaged_image_is_refused_and_a_burst_pulls_once_per_worker(fleet: DevFleet, tmp_path: Path) -> None:
    source = make_app(tmp_path / "burst", "x" * 1000)
    digest = json.loads(
        fauxmad(fleet, "image", "build", str(source), "--tag", "burst:v1", "--cmd", "python3 app.py", "--json").stdout
    )["digest"]
    bad_source = make_app(tmp_path / "bad", "to be damaged")
    bad = json.loads(fauxmad(fleet, "image", "build", str(bad_source), "--tag", "bad:v1", "--json").stdout)["digest"]

    async def main() -> tuple[list[Machine], Machine]:
        nc = await connect_nats(fleet.url)
        images = await Images.open(nc.jetstream())
        await images.store.put(bad, b"not the archive that digest names")  # the store now answers other bytes
        await nc.close()
        client = await FleetClient.connect(fleet.url)
        try:
            config = MachineConfig(image=digest, cmd=["python3", "app.py"], guest=Guest(cpus=1, memory_mb=64))
            made = await asyncio_gather(client, config, 6)
            settled = [await client.wait("burst", m.id, "started", timeout=30) for m in made]
            bad_config = MachineConfig(image=bad, cmd=["python3", "app.py"], guest=Guest(cpus=1, memory_mb=64))
            refused = await client.create("bad", CreateRequest(region="img", config=bad_config))
            refused = await client.get("bad", refused.id)
            return [await client.get("burst", m.id) for m in settled], refused
        finally:
            await client.close()

    burst, refused = arun(main())
    assert refused.state == "failed"
    reasons = " ".join(e.reason or "" for e in refused.events)
    assert "refused (damaged or overwritten)" in reasons
    pulls: dict[str, int] = {}
    for machine in burst:
        started = next(e for e in machine.events if e.status == "started")
        assert "image" in (started.reason or "")
        if "image pulled:" in (started.reason or ""):
            pulls[machine.worker_id] = pulls.get(machine.worker_id, 0) + 1
    assert pulls and all(n == 1 for n in pulls.values()), pulls


async def asyncio_gather(client: FleetClient, config: MachineConfig, n: int) -> list[Machine]:
    import asyncio

    return list(
        await asyncio.gather(*(client.create("burst", CreateRequest(region="img", config=config)) for _ in range(n)))
    )


def test_placement_prefers_the_worker_that_has_the_image_and_explain_says_so(fleet: DevFleet, tmp_path: Path) -> None:
    source = make_app(tmp_path / "warm", "warm")
    digest = json.loads(
        fauxmad(fleet, "image", "build", str(source), "--tag", "warm:v1", "--cmd", "python3 app.py", "--json").stdout
    )["digest"]

    async def main() -> tuple[str, list[tuple[str, float]]]:
        client = await FleetClient.connect(fleet.url)
        try:
            config = MachineConfig(image=digest, cmd=["python3", "app.py"], guest=Guest(cpus=1, memory_mb=64))
            first = await client.create("warm", CreateRequest(region="img", config=config))
            await client.destroy("warm", first.id, force=True)
            await asyncio_sleep(1.5)  # a heartbeat carries the cached digest (offers read it at once anyway)
            wins = []
            for _ in range(3):
                made = await client.create("warm", CreateRequest(region="img", config=config, explain=True))
                explained = msgspec.to_builtins(made.explain)
                best = next(w for w in explained["workers"] if w.get("rank") == 1)
                wins.append((made.worker_id, float(best["subscores"].get("image", 0.0))))
                await client.destroy("warm", made.id, force=True)
            return first.worker_id, wins
        finally:
            await client.close()

    cached_on, wins = arun(main())
    assert all(worker == cached_on and bonus > 0 for worker, bonus in wins), (cached_on, wins)


async def asyncio_sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def test_the_readme_image_commands_run_as_written(fleet: DevFleet) -> None:
    import re
    import shlex

    section = (
        (ROOT / "docs" / "tutorials" / "images-and-volumes.md")
        .read_text()
        .split("## Images:", 1)[1]
        .split("\n## ", 1)[0]
    )
    [block] = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert "image push" in block and "machine run --app echo --region mad --image echo:v1" in block
    for line in block.strip().splitlines():  # the tutorial's region is the dev fleet's mad: here, img
        done = fauxmad(fleet, *shlex.split(line.replace("--region mad", "--region img"))[1:])
        assert done.returncode == 0, f"{line}: {done.stderr}"
    assert "echo:stable" in fauxmad(fleet, "image", "ls").stdout
    (machine,) = json.loads(fauxmad(fleet, "machine", "list", "--app", "echo", "--json").stdout)
    assert machine["state"] == "started" and machine["config"]["image"].startswith("sha256:"), machine
    tagged = json.loads(fauxmad(fleet, "image", "inspect", "echo:v2").stdout)
    assert tagged["digest"] == machine["config"]["image"], tagged  # the pushed file: the same bytes
    assert fauxmad(fleet, "machine", "destroy", machine["id"], "--app", "echo", "--force").returncode == 0
    bad = fauxmad(fleet, "image", "build", "/nonexistent/dir", "--tag", "x:y")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not a directory" in bad.stderr
    bad_tag = fauxmad(fleet, "image", "build", "examples/echo", "--tag", "Bad Tag")
    assert bad_tag.returncode == 2 and "invalid tag" in bad_tag.stderr


OCI_APP = """import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"{os.environ.get('GREETING')} old={os.path.exists('old.txt')} cwd={os.path.basename(os.getcwd())}"
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body.encode())
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
"""


@pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci is not installed (Debian: apt-get install umoci)")
def test_an_oci_layout_made_by_umoci_imports_and_runs(fleet: DevFleet, tmp_path: Path) -> None:
    def umoci(*args: str) -> None:
        done = subprocess.run(["umoci", *args], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr

    umoci("init", "--layout", "lay")
    umoci("new", "--image", "lay:v1")
    umoci("unpack", "--image", "lay:v1", "bundle")
    app = tmp_path / "bundle" / "rootfs" / "srv"
    app.mkdir(parents=True)
    (app / "app.py").write_text(OCI_APP)
    (app / "old.txt").write_text("a layer below")
    umoci("repack", "--image", "lay:v1", "bundle")
    (app / "old.txt").unlink()  # the next layer carries a whiteout for it
    umoci("repack", "--image", "lay:v1", "bundle")
    umoci("config", "--image", "lay:v1", "--config.cmd", "python3", "--config.cmd", "app.py")
    umoci("config", "--image", "lay:v1", "--config.workingdir", "/srv", "--config.env", "GREETING=hola")

    imported = fauxmad(fleet, "image", "import", str(tmp_path / "lay"), "--ref", "v1", "--tag", "ociapp:v1", "--json")
    assert imported.returncode == 0, imported.stderr
    manifest = json.loads(imported.stdout)
    assert manifest["cmd"] == ["python3", "app.py"] and manifest["workdir"] == "srv"
    spec = tmp_path / "fauxmad.toml"
    spec.write_text(
        'app = "ociapp"\nimage = "ociapp:v1"\n[guest]\nmemory_mb = 64\n[regions]\nimg = 1\n[deploy]\nspares = 0\n'
    )
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    (machine,) = machines_of(fleet, "ociapp")
    assert wait_served(machine) == "hola old=False cwd=srv"
    bad = fauxmad(fleet, "image", "import", str(tmp_path / "bundle"))
    assert bad.returncode == 2 and "not an OCI image layout" in bad.stderr and "Traceback" not in bad.stderr
