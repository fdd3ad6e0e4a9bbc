"""The role x subject table in the README, walked cell by cell against a real nats-server.

The fleet directory comes from `FleetDir` (what `fauxmad fleet init` / `add-*` write); the server runs
with its `nats.conf` (mutual TLS, nkey users with their permissions). Each identity connects with its
credentials file. A spy (the operator, subscribed to `>`) sees what really went through:

- an allowed publish arrives at the spy; a forbidden one is refused by the server (a permissions
  violation reaches the publisher) and never arrives;
- an allowed subscription receives what the operator publishes; a forbidden one is refused and
  receives nothing.

Both sides are settled with PING/PONG round trips (flush), never with a sleep taken for a refusal.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from bus.local.embedded import find_binary
from bus.local.ports import free_port
from bus.transport import credentials
from orchestrator.security.fleetdir import FleetDir
from tests.helpers import ROOT, arun, wait_until

COLUMNS = {
    "worker mad-w1": "worker-mad-w1",
    "broker": "broker",
    "api": "api-1",
    "proxy": "proxy-1",
    "operator": "operator",
    "deployer of web": "ci-web",
    "viewer": "ops-bob",
}


def readme_matrix() -> list[tuple[str, str, dict[str, bool]]]:
    section = (
        (ROOT / "docs" / "how-to" / "secure-fleet.md").read_text().split("## Security:", 1)[1].split("\n## ", 1)[0]
    )
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    assert header[:2] == ["action", "subject"] and set(header[2:]) == set(COLUMNS), header
    cases = []
    for row in rows[1:]:
        if set(row) <= {"|", "-"}:
            continue
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        action, subject = cells[0], cells[1].strip("`")
        assert action in ("pub", "sub") and cells[2:] and all(c in ("yes", "no") for c in cells[2:]), row
        cases.append((action, subject, {header[i]: cells[i] == "yes" for i in range(2, len(header))}))
    return cases


@pytest.fixture(scope="module")
def secure_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetDir, str]]:
    root = tmp_path_factory.mktemp("secure")
    port = free_port()
    fleet = FleetDir(root / "fleet")
    fleet.init(port=port)
    fleet.add_worker("mad-w1", "mad")
    fleet.add_worker("mad-w2", "mad")
    fleet.add_user("broker", "broker")
    fleet.add_user("api-1", "api")
    fleet.add_user("proxy-1", "proxy")
    fleet.add_user("ci-web", "deployer", app="web")
    fleet.add_user("ops-bob", "viewer")
    server = subprocess.Popen(
        [find_binary(), "-c", str(fleet.config), "-l", str(root / "nats.log")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, server, root / "nats.log")
        yield fleet, f"tls://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _wait_listening(port: int, server: subprocess.Popen[bytes], log: Path) -> None:
    import socket

    def listening() -> bool:
        assert server.poll() is None, log.read_text() if log.exists() else "nats-server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    wait_until(listening, "nats-server listening", interval=0.02)


async def _connect(fleet: FleetDir, url: str, name: str, errors: list[str]) -> Client:
    creds, base = credentials.load(fleet.creds(name))

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(url, error_cb=on_error, allow_reconnect=False, **creds.connect_options(base))


async def _eventually(seen: Callable[[], bool], expected: bool) -> bool:
    """Whether a message arrived: delivered before the PONGs we awaited, but handed to its callback by a
    task of nats-py's, so wait for it (positively) when it is expected; when it is not, the refusal the
    caller also requires is the evidence, and a brief look is enough."""
    for _ in range(200 if expected else 5):
        if seen():
            return True
        await asyncio.sleep(0.01)
    return False


async def _refusal(errors: list[str], *, expected: bool) -> bool:
    """Whether the server said "permissions violation": its -ERR comes before the PONG we awaited, but
    nats-py hands it to the error callback in a task of its own, so give that task a moment when a
    refusal is expected (waiting for the positive signal; no refusal is ever inferred from silence)."""
    for _ in range(200 if expected else 1):
        if any("permissions violation" in e.lower() for e in errors):
            return True
        await asyncio.sleep(0.01)
    return False


def test_every_cell_of_the_readme_matrix(secure_fleet: tuple[FleetDir, str]) -> None:
    fleet, url = secure_fleet
    cases = readme_matrix()
    assert len(cases) >= 20

    async def main() -> list[str]:
        failures: list[str] = []
        spy_errors: list[str] = []
        spy = await _connect(fleet, url, "operator", spy_errors)
        seen: list[tuple[str, bytes]] = []

        async def record(msg: nats.aio.msg.Msg) -> None:
            seen.append((msg.subject, msg.data))

        await spy.subscribe(">", cb=record)
        await spy.flush()
        for n, (action, subject, cells) in enumerate(cases):
            for column, allowed in cells.items():
                errors: list[str] = []
                client = await _connect(fleet, url, COLUMNS[column], errors)
                token = f"probe-{n}-{column}".encode()
                try:
                    if action == "pub":
                        await client.publish(subject, token)
                        await client.flush()
                        await spy.flush()
                        arrived = await _eventually(lambda t=token: any(data == t for _, data in seen), allowed)
                    else:
                        got: list[bytes] = []

                        async def collect(msg: nats.aio.msg.Msg, into: list[bytes] = got) -> None:
                            into.append(msg.data)

                        await client.subscribe(subject, cb=collect)
                        await client.flush()
                        # from a fresh connection: nats-server caches, per publishing connection, who is
                        # subscribed to a subject, and a long-lived publisher sometimes kept delivering to
                        # the previous case's (closed) subscriber only (seen with 2 of 40 churned subscribers)
                        publisher = await _connect(fleet, url, "operator", [])
                        await publisher.publish(subject, token)
                        await publisher.flush()
                        await publisher.close()
                        await client.flush()
                        arrived = await _eventually(lambda t=token, g=got: t in g, allowed)
                    refused = await _refusal(errors, expected=not allowed)
                    if allowed and (not arrived or refused):
                        failures.append(f"{column} should {action} {subject}: arrived={arrived} errors={errors}")
                    if not allowed and (arrived or not refused):
                        failures.append(f"{column} must not {action} {subject}: arrived={arrived} errors={errors}")
                finally:
                    await client.close()
        await spy.close()
        return failures

    failures = arun(main())
    assert not failures, "\n".join(failures)


def test_a_stolen_worker_credential_cannot_answer_as_another_worker(secure_fleet: tuple[FleetDir, str]) -> None:
    """mad-w1's credentials subscribe to mad-w2's reserve subject: refused; a request to mad-w2 reaches
    only mad-w2 (its real agent), never the thief."""
    fleet, url = secure_fleet

    async def main() -> tuple[list[str], bytes, list[bytes]]:
        thief_errors: list[str] = []
        thief = await _connect(fleet, url, "worker-mad-w1", thief_errors)
        stolen: list[bytes] = []

        async def steal(msg: nats.aio.msg.Msg) -> None:
            stolen.append(msg.data)
            await msg.respond(b"fake")

        await thief.subscribe("fauxmad.v1.worker.mad-w2.machines.reserve", cb=steal)
        await thief.flush()
        real = await _connect(fleet, url, "worker-mad-w2", [])

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"real")

        await real.subscribe("fauxmad.v1.worker.mad-w2.machines.reserve", cb=answer)
        await real.flush()
        broker = await _connect(fleet, url, "broker", [])
        reply = await broker.request("fauxmad.v1.worker.mad-w2.machines.reserve", b"{}", timeout=5)
        for client in (thief, real, broker):
            await client.close()
        return thief_errors, reply.data, stolen

    errors, reply, stolen = arun(main())
    assert reply == b"real" and stolen == []
    assert any("permissions violation" in e.lower() for e in errors)


def test_without_a_client_certificate_the_server_refuses(secure_fleet: tuple[FleetDir, str]) -> None:
    fleet, url = secure_fleet
    creds, base = credentials.load(fleet.creds("operator"))
    options = creds.connect_options(base)
    import ssl

    no_cert = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(base / creds.ca))

    async def main() -> None:
        nc = await nats.connect(
            url, tls=no_cert, nkeys_seed_str=options["nkeys_seed_str"], allow_reconnect=False, connect_timeout=2
        )
        await nc.close()

    with pytest.raises(Exception):  # noqa: B017 - the TLS handshake fails (how depends on the ssl module)
        arun(main())


def test_credentials_files_are_private(secure_fleet: tuple[FleetDir, str]) -> None:
    fleet, _ = secure_fleet
    for name in COLUMNS.values():
        assert fleet.creds(name).stat().st_mode & 0o077 == 0, name
    assert (fleet.root / "ca-key.pem").stat().st_mode & 0o077 == 0
    assert re.search(r"verify: true", fleet.config.read_text())


@pytest.mark.fleet
def test_the_readme_commands_run_as_written_and_bad_input_is_one_line(tmp_path: Path) -> None:
    """The README's secure-fleet block, verbatim in a shell (its `~` is a fresh home), makes every identity the
    section runs: a server on its config, the fleet prepared by the operator, the worker and the broker with their
    own credentials, a deployer's create and a viewer's list."""
    from tests.orchestrator.cli.test_cli import fauxmad

    section = (
        (ROOT / "docs" / "how-to" / "secure-fleet.md").read_text().split("## Security:", 1)[1].split("\n## ", 1)[0]
    )
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]  # the fleet's; the secrets' run in test_secrets
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {k: v for k, v in os.environ.items() if k not in ("FAUXMAD_NATS_URL", "FAUXMAD_CREDS")}
    env.update(HOME=str(home), PATH=bin_dir, PYTHONPATH=str(ROOT))
    ran = subprocess.run(["bash", "-e", "-c", block], capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    directory = home / "fauxmad-secure"
    names = {e.identity.name for e in FleetDir(directory).entries()}
    assert names == {"operator", "worker-mad-w1", "broker-1", "proxy-1", "api-1", "ci-web", "ops-bob"}
    _run_the_readme_fleet(FleetDir(directory), env, tmp_path)

    again = fauxmad("fleet", "init", str(directory))
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1 and "already" in again.stderr
    bad_role = fauxmad("fleet", "add-user", "x", "--role", "root", "--dir", str(directory))
    assert bad_role.returncode == 2 and "unknown role" in bad_role.stderr
    no_app = fauxmad("fleet", "add-user", "y", "--role", "deployer", "--dir", str(directory))
    assert no_app.returncode == 2 and "--app" in no_app.stderr and "Traceback" not in no_app.stderr
    bad_name = fauxmad("fleet", "add-worker", "a.b", "--region", "mad", "--dir", str(directory))
    assert bad_name.returncode == 2 and len(bad_name.stderr.strip().splitlines()) == 1
    revoked = fauxmad("fleet", "revoke", "ops-bob", "--dir", str(directory))
    assert revoked.returncode == 0 and not (directory / "creds" / "ops-bob.json").exists()
    assert "ops-bob" not in (directory / "users.conf").read_text()
    nowhere = fauxmad("fleet", "add-worker", "w9", "--region", "mad", "--dir", "/nonexistent/fleet")
    assert nowhere.returncode == 2 and "fleet init" in nowhere.stderr


def _run_the_readme_fleet(fleet: FleetDir, env: dict[str, str], tmp_path: Path) -> None:
    """What the section says next, each process as its own identity: the server (on a free port rather than the
    block's 4333), `fleet prepare` as the operator, the worker and the broker; a deployer creates, a viewer lists."""
    port = free_port()
    url = f"tls://127.0.0.1:{port}"
    server = subprocess.Popen(
        [find_binary(), "-c", str(fleet.config), "-p", str(port), "-l", str(tmp_path / "nats.log")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs: list[subprocess.Popen[bytes]] = []

    def cli(identity: str, *args: str) -> subprocess.CompletedProcess[str]:
        as_it = dict(env, FAUXMAD_CREDS=str(fleet.creds(identity)), FAUXMAD_NATS_URL=url)
        command = [sys.executable, "-m", "orchestrator.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, env=as_it, timeout=60, cwd=str(ROOT))

    def spawn(identity: str, *args: str) -> None:
        as_it = dict(env, FAUXMAD_CREDS=str(fleet.creds(identity)), FAUXMAD_NATS_URL=url)
        log = open(tmp_path / f"{identity}.log", "wb")  # noqa: SIM115 - kept open for the process's life
        command = [sys.executable, "-m", "orchestrator.cli", *args]
        procs.append(subprocess.Popen(command, stdout=log, stderr=log, env=as_it, cwd=str(ROOT)))

    try:
        deadline = time.monotonic() + 20
        while cli("operator", "fleet", "prepare", "--regions", "mad").returncode != 0:
            assert time.monotonic() < deadline and server.poll() is None, "the README's fleet did not come up"
            time.sleep(0.2)
        spawn("worker-mad-w1", "worker", "--region", "mad", "--worker-id", "mad-w1", "--cpus", "2",
              "--memory-mb", "1024", "--data-dir", str(tmp_path / "w1"))  # fmt: skip
        spawn("broker-1", "broker")
        deadline = time.monotonic() + 30
        while True:
            listed = cli("ops-bob", "workers", "--json")
            if listed.returncode == 0 and len(json.loads(listed.stdout)) == 1:
                break
            assert time.monotonic() < deadline, listed.stderr
            time.sleep(0.2)
        run = cli("ci-web", "machine", "run", "-a", "web", "-r", "mad", "--json", "--", "sleep", "30")
        assert run.returncode == 0, run.stderr
        machines = cli("ops-bob", "machine", "list", "-a", "web", "--json")
        assert machines.returncode == 0 and [m["id"] for m in json.loads(machines.stdout)] == [
            json.loads(run.stdout)["id"]
        ]
        destroyed = cli("ci-web", "machine", "destroy", json.loads(run.stdout)["id"], "-a", "web", "--force")
        assert destroyed.returncode == 0, destroyed.stderr
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.terminate()
        server.wait(timeout=10)


def test_a_plain_connection_is_refused(secure_fleet: tuple[FleetDir, str]) -> None:
    """TLS is required: the same server, a client without TLS (even with a valid nkey) gets nowhere."""
    fleet, url = secure_fleet
    creds, _ = credentials.load(fleet.creds("operator"))

    async def main() -> None:
        nc = await nats.connect(
            url.replace("tls://", "nats://"),
            nkeys_seed_str=creds.seed,
            allow_reconnect=False,
            connect_timeout=2,
        )
        await nc.close()

    with pytest.raises(Exception):  # noqa: B017 - nats-py's error for a server that demands TLS varies
        arun(main())
