"""Images belong to apps, on a secure fleet with real processes (nats-server with TLS and the generated
permissions, a worker and a broker each its own identity, the CLI as deployers of `web` and of `victim`).

What must hold (docs/how-to/secure-fleet.md, who may do what with images):
- a deployer of `web` cannot move or rewrite `victim`'s tag, nor the manifest (default command) it names:
  directly the server refuses it, through the brokers' push the broker does; `victim:v1` is unchanged;
- nobody changes the bytes under a digest in use: a deployer cannot write the object store at all, and a
  push of a digest the store holds sends no bytes; the stored object stays the same bytes;
- a push whose bytes do not hash to their name is a one-line 400 naming both digests; nothing is stored;
- the deployer of `web` builds, pushes (in chunks: bigger than one NATS message), tags and runs its own
  image (`machine run --image`), and deploys a directory (`deploy` with `build =`, pushed the same way).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from nats.aio.client import Client

from bus.contract import subjects
from bus.contract.errors import BadRequest, Conflict, Forbidden
from bus.contract.images import ImageChunk, ImageManifest, ImagePushReply, ImagePushRequest
from bus.contract.streams import AuditRecord
from bus.local.embedded import find_binary
from bus.stores.image_push import push_image
from bus.stores.images import Images, build_archive, digest_of, manifest_for
from bus.transport.connection import connect
from bus.transport.jetstream import ensure_fleet_resources
from bus.transport.service import call, request
from orchestrator.apps.releases import Releases
from orchestrator.apps.spec import AppSpec
from orchestrator.apps.store import KVReleaseStore
from orchestrator.images import pin_image
from tests.helpers import arun, audit_records, kill_machines_of
from tests.orchestrator.security.test_secure_fleet import SecureFleet

T = TypeVar("T")
APP_PY = 'import os, time\nprint(open("stamp.txt").read().strip(), os.environ.get("GREETING"), flush=True)\ntime.sleep(600)\n'


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureFleet]:
    import socket

    secure = SecureFleet(tmp_path_factory.mktemp("image-owners"))
    secure.dir.init(port=secure.port)
    secure.dir.add_worker("img-w1", "mad")
    secure.dir.add_user("broker-1", "broker")
    secure.dir.add_user("ci-web", "deployer", app="web")
    secure.dir.add_user("ci-victim", "deployer", app="victim")
    server = subprocess.Popen(
        [find_binary(), "-c", str(secure.dir.config), "-l", str(secure.root / "nats.log")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", secure.port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "nats-server did not start"
                time.sleep(0.02)
        prepared = secure.cli("operator", "fleet", "prepare", "--nats", secure.url)
        assert prepared.returncode == 0, prepared.stderr
        secure.spawn(
            "worker-img-w1",
            *("worker", "--nats", secure.url, "--region", "mad", "--worker-id", "img-w1"),
            *("--cpus", "4", "--memory-mb", "4096", "--data-dir", str(secure.root / "img-w1"), "--max-load", "0"),
        )
        secure.spawn("broker-1", "broker", "--nats", secure.url)
        deadline = time.monotonic() + 30
        while True:
            listed = secure.cli("ci-web", "workers", "--json", "--nats", secure.url)
            if listed.returncode == 0 and len(json.loads(listed.stdout)) == 1:
                break
            assert time.monotonic() < deadline, f"no worker came up: {listed.stderr}"
            time.sleep(0.2)
        yield secure
    finally:
        for proc in secure.procs:
            proc.terminate()
        for proc in secure.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        subprocess.run(["pkill", "-f", str(secure.root)], check=False)  # processes whose command line names it
        kill_machines_of("img-w1", secure.root / "img-w1")  # machines the worker left (`python3 app.py` names no path)
        server.terminate()
        server.wait(timeout=10)


def as_identity(fleet: SecureFleet, identity: str, fn: Callable[[Client], Awaitable[T]]) -> T:
    async def main() -> T:
        nc = await connect(fleet.url, f"test-{identity}", creds=str(fleet.dir.creds(identity)))
        try:
            return await fn(nc)
        finally:
            await nc.close()

    return arun(main())


def image_dir(root: Path, stamp: str, big: bool = False) -> Path:
    root.mkdir(parents=True)
    (root / "app.py").write_text(APP_PY)
    (root / "stamp.txt").write_text(stamp + "\n")
    if big:  # incompressible: several NATS messages' worth, so the push goes in chunks
        (root / "blob.bin").write_bytes(os.urandom(3 << 20))
    return root


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def stored(fleet: SecureFleet, reference: str) -> tuple[str, ImageManifest, str]:
    """What the operator sees: the reference's digest, its manifest and the sha256 of its object's bytes."""

    async def look(nc: Client) -> tuple[str, ImageManifest, str]:
        images = await Images.open(nc.jetstream())
        digest = await images.resolve(reference)
        manifest = await images.manifest(digest)
        assert manifest is not None
        return digest, manifest, digest_of(await images._read(digest))

    return as_identity(fleet, "operator", look)


@pytest.fixture(scope="module")
def victim(fleet: SecureFleet, tmp_path_factory: pytest.TempPathFactory) -> str:
    """`victim:v1`, pushed by victim's deployer through the brokers: its digest."""
    source = image_dir(tmp_path_factory.mktemp("victim") / "src", "victim-stamp")
    done = fleet.cli(
        "ci-victim", "image", "build", str(source), "--tag", "victim:v1", "--cmd", "python3 app.py",
        "--json", "--nats", fleet.url,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = json.loads(done.stdout)
    assert manifest["app"] == "victim" and manifest["tags"] == ["victim:v1"]
    return str(manifest["digest"])


def test_a_deployer_cannot_move_or_rewrite_another_apps_tag(fleet: SecureFleet, victim: str, tmp_path: Path) -> None:
    before = stored(fleet, "victim:v1")
    assert before[0] == victim and before[1].cmd == ["python3", "app.py"] and before[2] == victim

    # the CLI: a tag of victim's is victim's push, which web's identity may not send (the server refuses it)
    evil = image_dir(tmp_path / "evil", "evil-stamp")
    moved = fleet.cli(
        "ci-web", "image", "build", str(evil), "--tag", "victim:v1", "--cmd", "sh -c pwned", "--nats", fleet.url
    )
    assert moved.returncode == 6 and "not allowed" in one_line(moved), moved.stderr
    retag = fleet.cli("ci-web", "image", "tag", "victim:v1", "victim:latest", "--nats", fleet.url)
    assert retag.returncode == 6 and "not allowed" in one_line(retag), retag.stderr

    async def attempts(nc: Client) -> list[str]:
        refused: list[str] = []
        # directly: the tag's key, the manifest's key (its default command), the object store
        for subject, payload in (
            (subjects.kv_put(subjects.IMAGE_TAGS_BUCKET, "t.victim.v1"), b"sha256:" + b"0" * 64),
            (subjects.kv_put(subjects.IMAGE_TAGS_BUCKET, "m." + victim[7:]), b'{"cmd": ["sh", "-c", "pwned"]}'),
        ):
            try:
                await request(nc, subject, payload)
            except Forbidden as exc:
                refused.append(exc.message)
        # through web's own push: a tag of victim's in it is the broker's 403
        manifest = ImageManifest(digest=victim, size=before[1].size, created=0, cmd=["python3", "app.py"])
        try:
            await call(
                nc, subjects.api_images_push("web"), ImagePushRequest(manifest=manifest, tags=["victim:v1"]),
                ImagePushReply,
            )  # fmt: skip
        except Forbidden as exc:
            refused.append(exc.message)
        # victim's digest with another default command, as web's: the broker's 409 (the digest is victim's)
        evil_manifest = ImageManifest(digest=victim, size=before[1].size, created=0, cmd=["sh", "-c", "pwned"])
        try:
            await call(
                nc, subjects.api_images_push("web"), ImagePushRequest(manifest=evil_manifest, tags=["web:evil"]),
                ImagePushReply,
            )  # fmt: skip
        except Conflict as exc:
            refused.append(exc.message)
        return refused

    refused = as_identity(fleet, "ci-web", attempts)
    assert len(refused) == 4, refused
    assert all("not allowed" in m for m in refused[:2]), refused
    assert "tag victim:v1 is not app web's" in refused[2], refused
    assert "is app victim's and has other defaults" in refused[3] and "pwned" in refused[3], refused

    after = stored(fleet, "victim:v1")
    assert after[0] == victim and after[1].cmd == ["python3", "app.py"] and after[2] == victim
    assert after[1].tags == ["victim:v1"] and after[1].app == "victim"
    gone = fleet.cli("operator", "image", "inspect", "web:evil", "--nats", fleet.url)
    assert gone.returncode == 4, "the refused push tagged nothing"


def test_nobody_changes_the_bytes_under_a_digest_in_use(fleet: SecureFleet, victim: str, tmp_path: Path) -> None:
    genuine = stored(fleet, "victim:v1")
    other = build_archive(image_dir(tmp_path / "other", "other-bytes"))

    async def attempts(nc: Client) -> tuple[list[str], ImagePushReply]:
        refused: list[str] = []
        # directly into the object store: a chunk, and the meta record naming victim's digest
        for subject in (f"$O.{subjects.IMAGES_STORE}.C.fakenuid", f"$O.{subjects.IMAGES_STORE}.M.c2hhMjU2"):
            try:
                await request(nc, subject, other)
            except Forbidden as exc:
                refused.append(exc.message)
        # through the brokers: a push of the digest the store holds is recorded without a byte sent (no upload)
        manifest = ImageManifest(digest=victim, size=len(other), created=0, cmd=["python3", "app.py"])
        reply = await call(
            nc, subjects.api_images_push("web"), ImagePushRequest(manifest=manifest, tags=["web:same"]),
            ImagePushReply,
        )  # fmt: skip
        return refused, reply

    refused, reply = as_identity(fleet, "ci-web", attempts)
    assert len(refused) == 2 and all("not allowed" in m for m in refused), refused
    assert reply.manifest is not None and not reply.upload, "no upload opened for a digest the store holds"
    assert reply.manifest.app == "victim" and reply.manifest.size == genuine[1].size
    after = stored(fleet, "victim:v1")
    assert after[2] == victim == genuine[2], "the object's bytes are unchanged"
    assert stored(fleet, "web:same")[0] == victim  # web may run victim's image under its own tag, nothing more


def test_a_push_whose_bytes_are_not_their_digest_is_a_one_line_400(fleet: SecureFleet, tmp_path: Path) -> None:
    real = build_archive(image_dir(tmp_path / "claimed", "claimed"))
    sent = build_archive(image_dir(tmp_path / "sent", "sent"))
    claimed, actual = digest_of(real), digest_of(sent)

    async def push(nc: Client) -> tuple[ImagePushReply, str]:
        manifest = ImageManifest(digest=claimed, size=len(sent), created=0, cmd=["python3", "app.py"])
        opened = await call(
            nc, subjects.api_images_push("web"), ImagePushRequest(manifest=manifest, tags=["web:bad"]), ImagePushReply
        )
        subject = subjects.api_images_upload("web", opened.broker, opened.upload)
        try:
            await call(nc, subject, ImageChunk(seq=0, data=sent, last=True), ImagePushReply)
        except BadRequest as exc:
            return opened, exc.message
        raise AssertionError("the broker took bytes that are not their digest")

    opened, message = as_identity(fleet, "ci-web", push)
    assert opened.upload and opened.chunk_bytes > 0
    assert "\n" not in message and claimed in message and actual in message and "refused" in message, message

    async def nothing(nc: Client) -> tuple[bool, ImageManifest | None]:
        images = await Images.open(nc.jetstream())
        return await images.present(claimed), await images.manifest(claimed)

    assert as_identity(fleet, "operator", nothing) == (False, None)
    assert fleet.cli("operator", "image", "inspect", "web:bad", "--nats", fleet.url).returncode == 4

    # the CLI's `image push` of a tampered archive: the same one line (checked before anything is sent)
    archive = tmp_path / "t.tgz"
    archive.write_bytes(sent)
    archive.with_name("t.tgz.json").write_bytes(
        json.dumps({"digest": claimed, "size": len(sent), "created": 0, "cmd": ["true"]}).encode()
    )
    pushed = fleet.cli("ci-web", "image", "push", str(archive), "--tag", "web:bad", "--nats", fleet.url)
    line = one_line(pushed)
    assert pushed.returncode == 2 and claimed in line and actual in line, line


def wait_log(fleet: SecureFleet, app: str, machine_id: str, text: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        logs = fleet.cli(f"ci-{app}", "logs", "-a", app, "--machine", machine_id, "--no-tail", "--nats", fleet.url)
        if text in logs.stdout:
            return
        assert time.monotonic() < deadline, logs.stdout + logs.stderr
        time.sleep(0.3)


def test_a_deployer_builds_pushes_tags_and_deploys_its_own_image(fleet: SecureFleet, tmp_path: Path) -> None:
    source = image_dir(tmp_path / "web", "web-stamp", big=True)
    built = fleet.cli(
        "ci-web", "image", "build", str(source), "--tag", "web:v1", "--cmd", "python3 app.py",
        "--env", "GREETING=hola", "--json", "--nats", fleet.url,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    manifest = json.loads(built.stdout)
    digest = manifest["digest"]
    assert manifest["app"] == "web" and manifest["size"] > 3 << 20  # several chunks
    assert stored(fleet, "web:v1")[2] == digest == digest_of(build_archive(source))

    again = fleet.cli("ci-web", "image", "build", str(source), "--tag", "web:v1", "--cmd", "python3 app.py",
                      "--env", "GREETING=hola", "--json", "--nats", fleet.url)  # fmt: skip
    assert again.returncode == 0 and json.loads(again.stdout)["digest"] == digest, again.stderr  # idempotent

    tagged = fleet.cli("ci-web", "image", "tag", "web:v1", "web:live", "--nats", fleet.url)
    assert tagged.returncode == 0 and digest in tagged.stdout, tagged.stderr
    assert stored(fleet, "web:live")[0] == digest

    archive = tmp_path / "web.tgz"
    out = fleet.cli("ci-web", "image", "build", str(source), "--out", str(archive), "--cmd", "python3 app.py",
                    "--env", "GREETING=hola")  # fmt: skip
    assert out.returncode == 0, out.stderr
    pushed = fleet.cli("ci-web", "image", "push", str(archive), "--tag", "web:v2", "--nats", fleet.url)
    assert pushed.returncode == 0, pushed.stderr
    assert stored(fleet, "web:v2")[0] == digest

    # run it: `machine run --image` (the deployer's create) pins the digest and runs the image's own command
    run = fleet.cli(
        "ci-web", "machine", "run", "-a", "web", "-r", "mad", "--image", "web:live", "--json", "--nats", fleet.url
    )
    assert run.returncode == 0, run.stderr
    machine = json.loads(run.stdout)
    assert machine["config"]["image"] == digest and machine["state"] == "started"
    wait_log(fleet, "web", machine["id"], "web-stamp hola")

    # a deploy's `build =` (`orchestrator.images.pin_image`) pushes through the brokers too, tagged web:<digest>
    rebuilt = image_dir(tmp_path / "rebuilt", "rebuilt-stamp")
    spec = AppSpec(app="web", build=str(rebuilt), cmd=["python3", "app.py"], regions={"mad": 1})

    async def pin(nc: Client) -> AppSpec:
        return await pin_image(nc.jetstream(), spec)

    pinned = as_identity(fleet, "ci-web", pin)
    new_digest = digest_of(build_archive(rebuilt))
    assert pinned.image == new_digest
    assert stored(fleet, f"web:{new_digest[7:19]}")[1].app == "web"
    run = fleet.cli(
        "ci-web", "machine", "run", "-a", "web", "-r", "mad", "--image", new_digest, "--json", "--nats", fleet.url
    )
    assert run.returncode == 0, run.stderr
    machine = json.loads(run.stdout)
    assert machine["config"]["image"] == new_digest
    wait_log(fleet, "web", machine["id"], "rebuilt-stamp")

    # the owner may push its digest again with other defaults (what `build --cmd` is for); the bytes stay
    changed = fleet.cli(
        "ci-web", "image", "build", str(source), "--tag", "web:v3", "--cmd", "python3 app.py --again",
        "--json", "--nats", fleet.url,
    )  # fmt: skip
    assert changed.returncode == 0, changed.stderr
    digest_now, manifest_now, bytes_now = stored(fleet, "web:v3")
    assert digest_now == digest == bytes_now and manifest_now.cmd == ["python3", "app.py", "--again"]
    assert manifest_now.app == "web" and {"web:v1", "web:live", "web:v2", "web:v3"} <= set(manifest_now.tags)

    # `fauxmad deploy` by web's deployer with `build = "."`: packed, pushed through the brokers, pinned, run
    shipped = image_dir(tmp_path / "shipped", "shipped-stamp")
    (shipped / "fauxmad.toml").write_text(
        'app = "web"\nbuild = "."\ncmd = ["python3", "app.py"]\n[guest]\nmemory_mb = 64\n[regions]\nmad = 1\n'
        "[deploy]\nspares = 0\n"
    )
    deployed = fleet.cli("ci-web", "deploy", "-c", str(shipped / "fauxmad.toml"), "--nats", fleet.url, timeout=180)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    shipped_digest = digest_of(build_archive(shipped))
    assert stored(fleet, f"web:{shipped_digest[7:19]}")[1].app == "web"
    listed = fleet.cli("ci-web", "machine", "list", "-a", "web", "--json", "--nats", fleet.url)
    assert listed.returncode == 0, listed.stderr
    ran = [m for m in json.loads(listed.stdout) if m["config"].get("image") == shipped_digest]
    assert ran and ran[0]["state"] == "started", listed.stdout
    wait_log(fleet, "web", ran[0]["id"], "shipped-stamp")


def upload_ends(fleet: SecureFleet, digest: str) -> list[AuditRecord]:
    """The audit trail's records of how uploads of `digest` to app `web` ended (as the operator reads them)."""

    async def read(nc: Client) -> list[AuditRecord]:
        found = await audit_records(nc, "web")
        return [r for r in found if r.upload is not None and r.upload.digest == digest]

    return as_identity(fleet, "operator", read)


def test_an_uploads_end_is_in_the_audit_trail(fleet: SecureFleet, tmp_path: Path) -> None:
    """Accepted (stored), refused (bytes that are not the digest) and failed (the broker stopped with the upload
    open): each recorded once, as the deployer that pushed, with the digest, the bytes received and why."""
    good = build_archive(image_dir(tmp_path / "good", "audited"))
    claimed = build_archive(image_dir(tmp_path / "claimed", "audited-claimed"))
    lost = build_archive(image_dir(tmp_path / "lost", "audited-lost"))

    async def pushes(nc: Client) -> str:
        manifest = manifest_for(good, cmd=["python3", "app.py"], env={}, workdir="", source="test")
        await push_image(nc, good, manifest, ["web:audited"])
        bad = ImageManifest(digest=digest_of(claimed), size=len(good), created=0, cmd=["python3", "app.py"])
        opened = await call(nc, subjects.api_images_push("web"), ImagePushRequest(manifest=bad), ImagePushReply)
        subject = subjects.api_images_upload("web", opened.broker, opened.upload)
        with pytest.raises(BadRequest):
            await call(nc, subject, ImageChunk(seq=0, data=good, last=True), ImagePushReply)
        open_one = ImageManifest(digest=digest_of(lost), size=len(lost), created=0, cmd=["python3", "app.py"])
        left = await call(nc, subjects.api_images_push("web"), ImagePushRequest(manifest=open_one), ImagePushReply)
        await call(
            nc, subjects.api_images_upload("web", left.broker, left.upload), ImageChunk(seq=0, data=lost[:100]),
            ImagePushReply,
        )  # fmt: skip
        return left.upload

    upload_left_open = as_identity(fleet, "ci-web", pushes)
    restart_broker(fleet)  # SIGTERM: the broker records the upload it still holds before it exits

    (accepted,) = upload_ends(fleet, digest_of(good))
    assert accepted.upload is not None and accepted.status == 200 and accepted.name == "ci-web"
    assert accepted.identity.startswith("nkey:U") and accepted.app == "web"
    assert accepted.path.startswith("fauxmad.v1.api.apps.web.images.upload.")
    assert (accepted.upload.outcome, accepted.upload.size, accepted.upload.reason) == ("accepted", len(good), "")

    (refused,) = upload_ends(fleet, digest_of(claimed))
    assert refused.upload is not None and refused.status == 400 and refused.name == "ci-web"
    assert (refused.upload.outcome, refused.upload.size) == ("refused", len(good))
    assert digest_of(claimed) in refused.upload.reason and digest_of(good) in refused.upload.reason

    (failed,) = upload_ends(fleet, digest_of(lost))
    assert failed.upload is not None and failed.status == 503 and failed.name == "ci-web"
    assert failed.request_id == upload_left_open and failed.path.endswith(f".{upload_left_open}")
    assert (failed.upload.outcome, failed.upload.size) == ("failed", 100)
    assert failed.upload.reason == "the broker stopped before the last chunk"


def restart_broker(fleet: SecureFleet) -> None:
    """Stop broker-1 with SIGTERM (as systemd does), and start it again; back when it answers."""
    (broker,) = [proc for proc in fleet.procs if "broker" in proc.args and proc.poll() is None]  # type: ignore[operator]
    broker.terminate()
    assert broker.wait(timeout=20) == 0
    fleet.spawn("broker-1", "broker", "--nats", fleet.url)
    deadline = time.monotonic() + 30
    while fleet.cli("ci-web", "workers", "--json", "--nats", fleet.url).returncode != 0:
        assert time.monotonic() < deadline, "broker-1 did not come back"
        time.sleep(0.2)


def test_a_deployer_removes_its_own_images_and_no_one_elses(fleet: SecureFleet, victim: str, tmp_path: Path) -> None:
    """`image rm` as web's deployer: its own image goes (archive, manifest, tags); another app's is refused (by the
    server for victim's tag, by the broker for victim's digest); an image of web's that another app tags, or pins
    in its current release, is refused as in use. Nothing refused changes the store."""

    def build(name: str, stamp: str) -> str:
        done = fleet.cli(
            "ci-web", "image", "build", str(image_dir(tmp_path / name, stamp)), "--tag", f"web:{name}",
            "--cmd", "python3 app.py", "--json", "--nats", fleet.url,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return str(json.loads(done.stdout)["digest"])

    def gone(digest: str) -> bool:
        async def look(nc: Client) -> bool:
            images = await Images.open(nc.jetstream())
            return not await images.present(digest) and await images.manifest(digest) is None

        return as_identity(fleet, "operator", look)

    # its own: removed, tags and bytes with it
    own = build("own", "own-stamp")
    removed = fleet.cli("ci-web", "image", "rm", "web:own", "--nats", fleet.url)
    assert removed.returncode == 0 and own in removed.stdout, removed.stderr
    assert gone(own) and fleet.cli("operator", "image", "inspect", "web:own", "--nats", fleet.url).returncode == 4

    # another app's: victim's tag (the server refuses victim's subject), victim's digest as web's (the broker)
    by_tag = fleet.cli("ci-web", "image", "rm", "victim:v1", "--nats", fleet.url)
    assert by_tag.returncode == 6 and "not allowed" in one_line(by_tag), by_tag.stderr
    by_digest = fleet.cli("ci-web", "image", "rm", victim, "--app", "web", "--nats", fleet.url)
    assert by_digest.returncode == 6 and f"image {victim} is app victim's, not app web's" in one_line(by_digest)
    assert stored(fleet, "victim:v1")[0] == victim and not gone(victim)

    # web's, in use by victim: tagged by victim's deployer (same defaults: allowed), or pinned by victim's release
    shared = build("shared", "shared-stamp")
    lent = fleet.cli("ci-victim", "image", "tag", "web:shared", "victim:borrowed", "--nats", fleet.url)
    assert lent.returncode == 0, lent.stderr
    in_use = fleet.cli("ci-web", "image", "rm", "web:shared", "--nats", fleet.url)
    assert in_use.returncode == 5, in_use.stderr
    assert f"image {shared} is still in use by app victim (tagged victim:borrowed)" in one_line(in_use)
    assert stored(fleet, "web:shared")[0] == shared and stored(fleet, "victim:borrowed")[0] == shared

    pinned = build("pinned", "pinned-stamp")

    async def release(nc: Client) -> None:  # victim's current release runs web's image (as a deploy pins it)
        kv = await ensure_fleet_resources(nc.jetstream())
        releases = Releases(KVReleaseStore(kv.apps))
        spec = AppSpec(app="victim", image=pinned, cmd=["python3", "app.py"], regions={"mad": 0})
        made = await releases.create(spec, "image rm test")
        await releases.point("victim", made.version)

    as_identity(fleet, "operator", release)
    still_used = fleet.cli("ci-web", "image", "rm", pinned, "--app", "web", "--nats", fleet.url)
    assert still_used.returncode == 5, still_used.stderr
    assert f"image {pinned} is still in use by app victim (its current release runs it)" in one_line(still_used)
    assert stored(fleet, "web:pinned")[0] == pinned and not gone(pinned)
