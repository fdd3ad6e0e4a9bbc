"""A deployer on a secure fleet: its whole first hour works as that identity, and every write outside its app is
refused at once, by name.

A secure `DevFleet` (mutual TLS, an nkey identity per process, nats-server enforcing each role's permissions) and
the CLI as a subprocess with `FAUXMAD_CREDS` set to the deployer of `web`'s credentials, never the operator's:
- the first hour: deploy (the reconciler reads and acts through the brokers' API of the app, `routes`), releases,
  scale, rollback, status, logs, secrets, an image built and pushed, a machine run, exec'd into and stopped;
- refusals: a write to another app (the brokers' API, the secrets, releases and image tags buckets) is a 403
  (exit 6) whose one line names the identity and the subject, not a timeout.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.contract import subjects
from bus.contract.errors import Forbidden
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.stores.secrets import SECRETS_BUCKET
from bus.transport.connection import connect
from bus.transport.service import call
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import fauxmad

REGION = "mad"
DEPLOYER = "ci-web"

SPEC = """\
app = "web"
cmd = ["sh", "-c", "echo web-up; exec python3 -m http.server --bind 127.0.0.1 \\"$PORT\\""]
env = { LEVEL = "{level}" }

[guest]
memory_mb = 64

[regions]
mad = 2

[checks.http]
type = "http"
interval = "200ms"
timeout = "1s"

[deploy]
strategy = "rolling"
wait_timeout = "30s"
"""


class Deployer:
    def __init__(self, dev: DevFleet, root: Path) -> None:
        self.dev = dev
        self.root = root
        assert dev.security is not None
        self.creds = str(dev.security.creds(DEPLOYER))

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return fauxmad(
            *args,
            url=self.dev.url,
            columns=120,
            timeout=timeout,
            env={"FAUXMAD_CREDS": self.creds},  # with `url`, both of the caller's are replaced
        )

    def ok(self, *args: str) -> str:
        done = self.cli(*args)
        assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
        return done.stdout

    def spec(self, level: str) -> str:
        path = self.root / f"fauxmad-{level}.toml"
        path.write_text(SPEC.replace("{level}", level))
        return str(path)


@pytest.fixture(scope="module")
def deployer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployer]:
    with DevFleet(FleetSpec(regions=[REGION], workers_per_region=2, cpus=4, memory_mb=2048, secure=True)) as dev:
        assert dev.security is not None
        dev.security.add_user(DEPLOYER, "deployer", app="web")
        assert dev.security.reload(), "the secure fleet's nats-server takes a new identity on SIGHUP"
        who = Deployer(dev, tmp_path_factory.mktemp("deployer"))
        deadline = time.monotonic() + 10
        while (listed := who.cli("workers", "--json")).returncode != 0:  # the reload is asynchronous
            assert time.monotonic() < deadline, listed.stderr
            time.sleep(0.1)
        yield who


def _one_refusal_line(done: subprocess.CompletedProcess[str], subject: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 6, done.stderr
    assert len(lines) == 1 and f"identity {DEPLOYER} may not publish to {subject}" in lines[0], done.stderr
    assert "did not answer" not in done.stderr and "Traceback" not in done.stderr


def test_the_deployers_first_hour_runs_as_the_deployer(deployer: Deployer) -> None:
    deployed = deployer.cli("deploy", "-c", deployer.spec("info"))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "v1 deployed" in deployed.stdout

    releases = json.loads(deployer.ok("releases", "--app", "web", "--json"))
    assert releases["current"] == 1 and [r["version"] for r in releases["releases"]] == [1], releases

    deployer.ok("scale", "count", "3", "--app", "web")
    machines = json.loads(deployer.ok("machine", "list", "--app", "web", "--json"))
    assert sum(m["state"] == "started" for m in machines) == 3, machines

    again = deployer.cli("deploy", "-c", deployer.spec("debug"))
    assert again.returncode == 0, again.stdout + again.stderr
    rolled = deployer.cli("rollback", "--app", "web")
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    history = json.loads(deployer.ok("releases", "--app", "web", "--json"))
    assert len(history["releases"]) == 3 and history["current"] == 2, history  # back to the scaled release

    assert "web" in deployer.ok("status", "-a", "web")
    assert deployer.cli("logs", "-a", "web", "-n", "5").returncode == 0

    deployer.ok("secrets", "set", "-a", "web", "API_KEY=abc", "--stage")
    assert "API_KEY" in deployer.ok("secrets", "list", "-a", "web")

    site = deployer.root / "site"
    site.mkdir(exist_ok=True)
    (site / "index.html").write_text("hello from web\n")
    built = deployer.cli("image", "build", str(site), "--tag", "web:v1", "--cmd", "python3 -m http.server")
    assert built.returncode == 0, built.stdout + built.stderr

    run = json.loads(deployer.ok("machine", "run", "-a", "web", "-r", REGION, "--json", "--", "sleep", "120"))
    assert run["state"] == "started"
    said = deployer.cli("machine", "exec", run["id"], "-a", "web", "--", "sh", "-c", "echo hi-from-$FAUXMAD_MACHINE_ID")
    assert said.returncode == 0 and said.stdout.strip() == f"hi-from-{run['id']}", said.stderr
    deployer.ok("machine", "stop", run["id"], "-a", "web")
    deployer.ok("machine", "destroy", run["id"], "-a", "web", "--force")


def test_a_deployers_writes_elsewhere_are_refused_at_once_by_name(deployer: Deployer) -> None:
    _one_refusal_line(deployer.cli("secrets", "set", "-a", "other", "A=1"), subjects.kv_put(SECRETS_BUCKET, "other.A"))
    _one_refusal_line(
        deployer.cli("machine", "run", "-a", "other", "-r", REGION, "--", "true"),
        subjects.api_machines("other", "create"),
    )
    other = deployer.root / "other.toml"
    other.write_text(SPEC.replace('app = "web"', 'app = "other"').replace("{level}", "x"))
    # its first look at the app (the brokers' list of `other`) is already refused: nothing is written
    _one_refusal_line(deployer.cli("deploy", "-c", str(other)), subjects.api_machines("other", "list"))

    async def in_process() -> list[Forbidden]:
        nc = await connect(deployer.dev.url, "refusals", creds=deployer.creds)
        caught: list[Forbidden] = []
        try:
            config = MachineConfig(cmd=["true"], guest=Guest(cpus=1, memory_mb=16))
            with pytest.raises(Forbidden) as api:
                await call(nc, subjects.api_machines("other", "create"), CreateRequest(region=REGION, config=config),
                           Machine, timeout=30)  # fmt: skip
            caught.append(api.value)
            js = nc.jetstream()
            for subject in (
                subjects.kv_put(SECRETS_BUCKET, "other.TOKEN"),
                subjects.kv_put(subjects.APPS_BUCKET, "other.head"),
                subjects.kv_put(subjects.IMAGE_TAGS_BUCKET, "t.other.v1"),
            ):
                with pytest.raises(Forbidden) as kv:
                    await js.publish(subject, b"{}", timeout=30)
                caught.append(kv.value)
        finally:
            await nc.close()
        return caught

    refusals = asyncio.run(in_process())
    assert [r.code for r in refusals] == [403] * 4
    for refusal, where in zip(
        refusals,
        ("fauxmad.v1.api.apps.other.machines.create", "other.TOKEN", "other.head", "t.other.v1"),
        strict=True,
    ):
        assert refusal.message.startswith(f"identity {DEPLOYER} may not publish to ") and where in refusal.message
