"""A secure fleet with real processes: nats-server with the generated config, a worker and a broker each
with its own credentials, and CLI commands as a deployer, a viewer and a revoked identity.

What must hold: the whole create path works with least privilege (nothing needs more than its role);
a deployer of `web` is refused `other` at once with a 403 (exit 6, one line), never a timeout taken for
a refusal; a viewer reads but cannot create; a revoked identity is cut off on the next connection.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.local.embedded import find_binary
from bus.local.ports import free_port, machine_ports
from orchestrator.security.fleetdir import FleetDir
from tests.helpers import ROOT, fauxmad, kill_machines_of


class SecureFleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"tls://127.0.0.1:{self.port}"
        self.dir = FleetDir(root / "fleet")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.machine_user_data = root / "unused"

    def cli(self, identity: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        creds = str(self.dir.creds(identity))
        return fauxmad(
            *args,
            columns=120,
            timeout=timeout,
            env={"FAUXMAD_CREDS": creds},
            drop=("FAUXMAD_NATS_URL",),
        )

    def spawn(self, identity: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("FAUXMAD_NATS_URL", "FAUXMAD_CREDS")}
        env.update(PYTHONPATH=str(ROOT), FAUXMAD_CREDS=str(self.dir.creds(identity)))
        log = open(self.root / f"{identity}.log", "wb")  # noqa: SIM115 - kept open for the process's life
        self.procs.append(
            subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *args], stdout=log, stderr=log, env=env)
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureFleet]:
    secure = SecureFleet(tmp_path_factory.mktemp("secure-fleet"))
    secure.dir.init(port=secure.port)
    secure.dir.add_worker("sec-w1", "mad")
    secure.dir.add_worker("sec-w2", "mus")  # runs its machines as `nobody` (--machine-user)
    secure.dir.add_user("broker-1", "broker")
    secure.dir.add_user("ci-web", "deployer", app="web")
    secure.dir.add_user("ops-bob", "viewer")
    secure.dir.add_user("gone", "viewer")
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
        # the regions' job queues too (without them the workers run without jobs: a queued job's status is tested)
        prepared = secure.cli("operator", "fleet", "prepare", "--nats", secure.url, "--regions", "mad,mus")
        assert prepared.returncode == 0, prepared.stderr
        data = secure.root / "sec-w1"
        w1_ports, w2_ports = machine_ports().halves()  # two workers on one loopback: apart (bus/local/ports.py)
        secure.spawn(
            "worker-sec-w1",
            *("worker", "--nats", secure.url, "--region", "mad", "--worker-id", "sec-w1"),
            *("--cpus", "4", "--memory-mb", "4096", "--data-dir", str(data), "--max-load", "0"),
            *("--machine-ports", str(w1_ports)),
        )
        secure.machine_user_data = Path(tempfile.mkdtemp(prefix="fauxmad-machine-user-"))  # /tmp lets others pass
        secure.spawn(
            "worker-sec-w2",
            *("worker", "--nats", secure.url, "--region", "mus", "--worker-id", "sec-w2"),
            *("--cpus", "4", "--memory-mb", "4096", "--data-dir", str(secure.machine_user_data)),
            *("--machine-user", "nobody", "--max-load", "0", "--machine-ports", str(w2_ports)),
        )
        secure.spawn("broker-1", "broker", "--nats", secure.url)
        deadline = time.monotonic() + 30
        while True:
            listed = secure.cli("ops-bob", "workers", "--json", "--nats", secure.url)
            if listed.returncode == 0 and len(json.loads(listed.stdout)) == 2:
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
        subprocess.run(["pkill", "-f", str(secure.root)], check=False)  # processes whose command line names them
        subprocess.run(["pkill", "-f", str(secure.machine_user_data)], check=False)
        # machines the workers left (a machine's command line need not name a path)
        kill_machines_of("sec-w1", secure.root / "sec-w1")
        kill_machines_of("sec-w2", secure.machine_user_data)
        shutil.rmtree(secure.machine_user_data, ignore_errors=True)
        server.terminate()
        server.wait(timeout=10)


def test_a_deployer_creates_in_its_app_and_is_refused_elsewhere_at_once(fleet: SecureFleet) -> None:
    run = fleet.cli(
        "ci-web", "machine", "run", "-a", "web", "-r", "mad", "--json", "--nats", fleet.url, "--", "sleep", "60"
    )
    assert run.returncode == 0, run.stderr
    machine = json.loads(run.stdout)
    assert machine["state"] == "started" and machine["worker_id"] == "sec-w1"

    other = fleet.cli("ci-web", "machine", "run", "-a", "other", "-r", "mad", "--nats", fleet.url, "--", "sleep", "60")
    # refused by the server, not a request left to time out: exit 6 and "not allowed" are the refusal's (a
    # timeout would be another code and another message)
    assert other.returncode == 6, other.stderr
    assert len(other.stderr.strip().splitlines()) == 1 and "not allowed" in other.stderr

    destroyed = fleet.cli("ci-web", "machine", "destroy", machine["id"], "-a", "web", "--force", "--nats", fleet.url)
    assert destroyed.returncode == 0, destroyed.stderr


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)")
def test_a_sandboxed_machine_has_no_way_to_the_workers_credentials(fleet: SecureFleet) -> None:
    creds = fleet.dir.creds("worker-sec-w1")
    seed = json.loads(creds.read_text())["seed"]
    base = ("-a", "web", "--nats", fleet.url)
    run = fleet.cli("ci-web", "machine", "run", *base, "-r", "mad", "--sandbox", "bwrap", "--json", "--", "sleep", "60")
    assert run.returncode == 0, run.stderr
    machine_id = json.loads(run.stdout)["id"]
    try:
        looked = fleet.cli("ci-web", "machine", "exec", machine_id, *base, "--", "sh", "-c", f"env; cat {creds}")
        assert looked.returncode != 0, "the credentials file is not in the sandbox"
        assert "No such file" in looked.stdout + looked.stderr
        assert seed not in looked.stdout + looked.stderr and "FAUXMAD_CREDS" not in looked.stdout
    finally:
        fleet.cli("ci-web", "machine", "destroy", machine_id, *base, "--force")


def test_a_machine_runs_as_the_machine_user_and_cannot_read_the_workers_files(fleet: SecureFleet) -> None:
    creds = fleet.dir.creds("worker-sec-w2")
    seed = json.loads(creds.read_text())["seed"]
    data = fleet.machine_user_data
    base = ("-a", "web", "--nats", fleet.url)
    run = fleet.cli(
        "ci-web", "machine", "run", *base, "-r", "mus", "--json", "--", "sh", "-c", "id -u > uid; exec sleep 60"
    )
    assert run.returncode == 0, run.stderr
    machine = json.loads(run.stdout)
    assert machine["worker_id"] == "sec-w2"
    try:
        script = (
            f'cat uid; id -u; echo "home=$HOME"; touch written && echo wrote; cat {creds}; ls {data}; '
            f"cat {data}/lmdb/data.mdb | wc -c; ls {data}/machines; env"
        )
        looked = fleet.cli("ci-web", "machine", "exec", machine["id"], *base, "--", "sh", "-c", script)
        out = looked.stdout + looked.stderr
        lines = looked.stdout.splitlines()
        nobody = str(pwd.getpwnam("nobody").pw_uid)
        assert lines[:2] == [nobody, nobody], out  # the machine and an exec in it both run as nobody
        assert lines[2] == f"home={data / 'machines' / machine['id'] / 'home'}", out
        assert "wrote" in lines, out  # its own home is writable
        assert out.count("Permission denied") >= 4, out  # credentials, data dir, LMDB, the machines' folder
        assert seed not in out and "FAUXMAD_CREDS" not in out and "lock.mdb" not in out  # no listing of its data
    finally:
        fleet.cli("ci-web", "machine", "destroy", machine["id"], *base, "--force")


def test_a_viewer_reads_and_cannot_create(fleet: SecureFleet) -> None:
    listed = fleet.cli("ops-bob", "machine", "list", "-a", "web", "--json", "--nats", fleet.url)
    assert listed.returncode == 0, listed.stderr
    create = fleet.cli("ops-bob", "machine", "run", "-a", "web", "-r", "mad", "--nats", fleet.url, "--", "true")
    assert create.returncode == 6 and "not allowed" in create.stderr


def test_a_queued_jobs_status_and_list_answer_from_any_regions_desk(fleet: SecureFleet) -> None:
    """A queued job has no record until a worker takes it: its status is read from its region's work queue by
    whichever worker's desk the request reaches, here either region's (mad's desk answered `mus`'s queued job
    with a 403: it could not read that queue)."""
    deadline = time.monotonic() + 20
    while True:  # the workers are listed (the fixture's wait) a moment before their job desks subscribe
        submitted = fleet.cli(
            *("ci-web", "job", "submit", "-a", "web", "-r", "mus", "--count", "6", "--runner", "process"),
            *("--json", "--nats", fleet.url, "--", "sleep", "60"),
        )
        if "nobody answers" not in submitted.stderr or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert submitted.returncode == 0, submitted.stderr
    ids = [job["id"] for job in json.loads(submitted.stdout)]
    try:
        states = []
        for job_id in ids * 2:  # twice each: the desks are a queue group, so both regions' answer some
            status = fleet.cli("ops-bob", "job", "status", job_id, "-a", "web", "--json", "--nats", fleet.url)
            assert status.returncode == 0, status.stderr
            states.append(json.loads(status.stdout)["state"])
        assert "queued" in states and set(states) <= {"queued", "running"}, states  # 4 slots on mus, 6 jobs
        listed = fleet.cli("ops-bob", "job", "list", "-a", "web", "--state", "queued", "--json", "--nats", fleet.url)
        assert listed.returncode == 0, listed.stderr
        assert {job["id"] for job in json.loads(listed.stdout)} & set(ids)
    finally:
        for job_id in ids:
            fleet.cli("ci-web", "job", "cancel", job_id, "-a", "web", "--nats", fleet.url)


def test_a_revoked_identity_is_cut_off(fleet: SecureFleet) -> None:
    kept = fleet.root / "gone-copy"
    kept.mkdir(exist_ok=True)
    for name in ("gone.json", "gone.pem", "gone-key.pem"):
        shutil.copy(fleet.dir.root / "creds" / name, kept / name)
    (kept / "gone.json").write_text(
        (kept / "gone.json").read_text().replace('"../ca.pem"', json.dumps(str(fleet.dir.root / "ca.pem")))
    )
    revoked = fleet.cli("operator", "fleet", "revoke", "gone", "--dir", str(fleet.dir.root))
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    deadline = time.monotonic() + 10
    while True:  # the server re-reads its users on SIGHUP, asynchronously
        after = fauxmad(
            "workers",
            "--nats",
            fleet.url,
            timeout=60,
            env={"FAUXMAD_CREDS": str(kept / "gone.json")},
            drop=("FAUXMAD_NATS_URL",),
        )
        if after.returncode != 0:
            break
        assert time.monotonic() < deadline, "the revoked identity still gets in"
        time.sleep(0.1)
    assert after.returncode == 6 and "refused these credentials" in after.stderr, after.stderr


@pytest.mark.fleet  # starts processes of its own
def test_a_secure_dev_fleet_runs_machines_and_deploys(tmp_path: Path) -> None:
    """`fauxmad dev --secure`'s fleet: every process its own identity over mutual TLS; the operator deploys."""
    from orchestrator.devfleet import DevFleet, FleetSpec

    with DevFleet(FleetSpec(regions=["mad", "syd"], workers_per_region=1, secure=True)) as dev:
        assert dev.url.startswith("tls://") and dev.operator_creds is not None and dev.security is not None
        names = {entry.identity.name for entry in dev.security.entries()}
        assert {"operator", "worker-mad-w1", "worker-syd-w1", "broker-1"} <= names
        deploy = fauxmad(
            "deploy",
            "-c",
            "examples/sandwich/fauxmad.toml",
            "--nats",
            dev.url,
            env={"FAUXMAD_CREDS": str(dev.operator_creds)},
            drop=("FAUXMAD_NATS_URL",),
        )
        assert deploy.returncode == 0, deploy.stderr
        plain = fauxmad(
            "workers",
            "--nats",
            dev.url.replace("tls://", "nats://"),
            timeout=60,
            drop=("FAUXMAD_NATS_URL", "FAUXMAD_CREDS"),
        )
        assert plain.returncode != 0 and "Traceback" not in plain.stderr


def _served_certificate(fleet: SecureFleet) -> bytes:
    """The certificate nats-server presents now (NATS sends INFO in the clear, then TLS begins)."""
    import ssl

    context = ssl.create_default_context(cafile=str(fleet.dir.root / "ca.pem"))
    creds = fleet.dir.root / "creds"
    context.load_cert_chain(str(creds / "ops-bob.pem"), str(creds / "ops-bob-key.pem"))
    with socket.create_connection(("127.0.0.1", fleet.port), timeout=5) as raw:
        raw.recv(4096)  # INFO {...}
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            served = tls.getpeercert(binary_form=True)
    assert served is not None
    return served


def test_certificates_rotate_without_dropping_a_connection(fleet: SecureFleet) -> None:
    import asyncio

    from bus.transport.connection import connect

    before = _served_certificate(fleet)

    async def main() -> tuple[int, bool]:
        nc = await connect(fleet.url, "rotation-watch", creds=str(fleet.dir.creds("operator")))
        try:
            await nc.request("fauxmad.v1.api.workers.list", b"{}", timeout=10)
            rotated = fleet.cli("operator", "fleet", "rotate", "--dir", str(fleet.dir.root))
            assert rotated.returncode == 0 and "new certificates for server" in rotated.stdout, rotated.stderr
            for _ in range(100):  # the SIGHUP reload: until new connections get the new certificate
                if await asyncio.to_thread(_served_certificate, fleet) != before:
                    break
                await asyncio.sleep(0.1)
            await nc.request("fauxmad.v1.api.workers.list", b"{}", timeout=10)  # the same connection still works
            return nc.stats["reconnects"], nc.is_connected
        finally:
            await nc.close()

    reconnects, connected = asyncio.run(main())
    assert reconnects == 0 and connected
    after = _served_certificate(fleet)
    assert after != before, "new connections get the new server certificate"
    listed = fleet.cli("ops-bob", "workers", "--json", "--nats", fleet.url)  # a client with its rotated certificate
    assert listed.returncode == 0 and json.loads(listed.stdout), listed.stderr
    unknown = fleet.cli("operator", "fleet", "rotate", "nobody", "--dir", str(fleet.dir.root))
    assert unknown.returncode == 2 and "no identity nobody" in unknown.stderr


def test_every_mutating_nats_request_is_audited_with_the_identity_that_signed_it(fleet: SecureFleet) -> None:
    import asyncio

    import msgspec
    import nats
    import nkeys

    from bus.contract.errors import Forbidden
    from bus.contract.fleet import CreateRequest
    from bus.contract.machines import Guest, MachineConfig
    from bus.contract.streams import AuditRecord
    from bus.transport import credentials
    from bus.transport.service import raise_for_reply
    from bus.transport.signing import RequestSigner
    from tests.helpers import audit_records, wait_until

    run = fleet.cli(
        "ci-web", "machine", "run", "-a", "web", "-r", "mad", "--json", "--nats", fleet.url, "--", "sleep", "60"
    )
    assert run.returncode == 0, run.stderr
    machine_id = json.loads(run.stdout)["id"]
    listed = fleet.cli("ops-bob", "machine", "list", "-a", "web", "--json", "--nats", fleet.url)
    assert listed.returncode == 0, listed.stderr
    destroyed = fleet.cli("ci-web", "machine", "destroy", machine_id, "-a", "web", "--force", "--nats", fleet.url)
    assert destroyed.returncode == 0, destroyed.stderr
    before = fleet.cli("ops-bob", "machine", "list", "-a", "web", "--json", "--nats", fleet.url)
    web, _ = credentials.load(fleet.dir.creds("ci-web"))
    web_key = nkeys.from_seed(web.seed.encode()).public_key.decode()
    create = "fauxmad.v1.api.apps.web.machines.create"
    payload = msgspec.json.encode(
        CreateRequest(region="mad", config=MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=16)))
    )

    async def connect(name: str) -> nats.NATS:
        creds, base = credentials.load(fleet.dir.creds(name))
        return await nats.connect(fleet.url, **creds.connect_options(base))

    async def refused(headers: dict[str, str], data: bytes) -> str:
        nc = await connect("ci-web")
        try:
            with pytest.raises(Forbidden) as caught:
                raise_for_reply(await nc.request(create, data, timeout=10, headers=headers))
            return caught.value.message
        finally:
            await nc.close()

    # signed by another key while naming ci-web's; ci-web's own signature over another payload; a stale one
    stranger = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    forged = {**RequestSigner(stranger, "ci-web").headers(create, payload), "Fauxmad-Identity": web_key}
    altered = RequestSigner(web.seed, "ci-web").headers(create, b'{"region":"mad"}')
    stale = RequestSigner(web.seed, "ci-web", clock=lambda: time.time() - 600).headers(create, payload)
    assert "does not verify" in asyncio.run(refused(forged, payload))
    assert "does not verify" in asyncio.run(refused(altered, payload))
    assert "signed 600s ago" in asyncio.run(refused(stale, payload))
    again = fleet.cli("ops-bob", "machine", "list", "-a", "web", "--json", "--nats", fleet.url)
    assert json.loads(again.stdout) == json.loads(before.stdout)  # the refused creates made nothing

    async def records() -> list[AuditRecord]:
        nc = await connect("operator")
        try:
            return await audit_records(nc, "web")
        finally:
            await nc.close()

    def with_the_create() -> list[AuditRecord]:  # a create's record is sent by its worker after the reply
        found = [r for r in asyncio.run(records()) if r.method == "NATS"]
        return found if any(".machines.create" in r.path and r.status == 200 for r in found) else []

    nats_records = wait_until(with_the_create, "the create's audit record in the audit stream", 20.0)
    by_path = {(r.path.split(".")[6], r.identity, r.status) for r in nats_records}  # the verb (a region may follow)
    assert ("create", f"nkey:{web_key}", 200) in by_path
    assert ("destroy", f"nkey:{web_key}", 200) in by_path
    assert [r.status for r in nats_records if r.identity == "refused"] == [403, 403, 403]
    assert {r.name for r in nats_records if r.identity == f"nkey:{web_key}"} == {"ci-web"}
    assert not [r for r in nats_records if r.path.endswith((".list", ".get"))]  # reads are not recorded
