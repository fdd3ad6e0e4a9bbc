"""The web console on a secure fleet, run as a team runs one: `fauxmad dev --secure`'s fleet (mutual TLS, an
identity per worker and broker), the operator (`fauxmad reconcile --watch`) converging an app, an edge proxy in
front of it (with the operator's credentials: the proxy role's own test is test_proxy_role's), and `fauxmad api`
with the console as `api-1`, the identity of role `api` that the secure dev fleet makes. The API serves HTTPS with
the certificate the fleet's CA issued to `api-1` (no option: a secure fleet's default), which a client trusting the
fleet's CA accepts. Every page answers with its content, a page's event stream carries a machine's event, and the
tokens act as they should: the operator's on any app, a deployer's on its own app only, a read-only token not at
all. No browser."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.transport.credentials import CREDS_ENV
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.security.tokens import new_root_key
from tests.helpers import arun, connect_nats, fauxmad, wait_until
from tests.orchestrator import proxy_kit as kit
from tests.orchestrator.api.test_api import start_api
from tests.orchestrator.console.test_console import SLEEP, Console


class SecureConsole(Console):
    def __init__(
        self, fleet: DevFleet, base: str, key: bytes, proxy: kit.ProxyProcess, context: ssl.SSLContext
    ) -> None:
        super().__init__(fleet, base, key, context)
        self.proxy = proxy


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureConsole]:
    here = tmp_path_factory.mktemp("console-secure")
    key = new_root_key()
    (here / "token.key").write_bytes(key)
    spec = FleetSpec(
        regions=["mad"], workers_per_region=2, cpus=4, memory_mb=4096, brokers=1, operators=True, secure=True
    )
    with DevFleet(spec) as fleet, pytest.MonkeyPatch.context() as env:
        assert fleet.url.startswith("tls://") and fleet.operator_creds is not None and fleet.security is not None
        env.setenv(CREDS_ENV, fleet.operator_creds)  # what `fauxmad dev --secure` tells a person to export
        proxy = kit.ProxyProcess(fleet.url, "mad", here)
        env.setenv(CREDS_ENV, str(fleet.security.creds("api-1")))  # made with the fleet, as `fauxmad dev --secure` does
        wait_until(lambda: _connects(fleet.url), "the server knows api-1 (reloaded)", timeout=20, interval=0.2)
        context = ssl.create_default_context(cafile=str(fleet.security.root / "ca.pem"))  # the fleet's CA only
        api, base = start_api(
            fleet.url,
            ["--token-key", str(here / "token.key"), "--proxy-metrics", f"http://127.0.0.1:{proxy.admin}/metrics"],
            context=context,
        )
        assert base.startswith("https://")
        env.setenv(CREDS_ENV, fleet.operator_creds)  # this test's own clients and CLI commands: the operator
        assert f"{CREDS_ENV}={fleet.security.creds('api-1')}".encode() in Path(f"/proc/{api.pid}/environ").read_bytes()
        try:
            console = SecureConsole(fleet, base, key, proxy, context)
            arun(kit.publish(fleet.url, kit.spec_for("web", {"mad": 1}, "auto_start = true\n")))
            wait_until(  # the operator process converges it: one machine, started, served by the edge
                lambda: [m["state"] for m in _machines(console, "web")] == ["started"],
                "the operator started web's machine",
                timeout=30,
                interval=0.3,
            )
            wait_until(
                lambda: arun(kit.get(proxy.port, "web.localhost")).status == 200,
                "the edge proxy serves web",
                timeout=20,
                interval=0.3,
            )
            yield console
        finally:
            api.terminate()
            api.wait(10)
            proxy.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return fauxmad(*args, timeout=60)


def _connects(url: str) -> bool:
    async def attempt() -> None:
        nc = await connect_nats(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        await nc.close()

    try:
        arun(attempt())
    except Exception:
        return False
    return True


def _machines(console: SecureConsole, app: str) -> list[dict[str, Any]]:
    status, found = console.api().call("GET", f"/v1/apps/{app}/machines")
    assert status == 200, found
    return list(found)


def _job(console: SecureConsole) -> str:
    """A background job of `web` run to its end by a worker, submitted as the operator; its id."""
    done = _cli(
        "job", "submit", "--nats", console.fleet.url, "-a", "web", "-r", "mad", "--wait", "--json", "--", "echo", "made"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"\bj[0-9a-f]{15}\b", done.stdout)
    assert found is not None, done.stdout
    return found.group(0)


def test_every_page_answers_with_its_content_on_a_secure_fleet(secure: SecureConsole) -> None:
    (web,) = _machines(secure, "web")
    job_id = _job(secure)

    status, body = secure.get("/ui/", secure.operator)
    assert status == 200 and f'data-machine="{web["id"]}"' in body and 'data-worker="mad-w1"' in body, body[-2000:]
    assert 'class="error"' not in body  # the view is followed (no "cannot follow the fleet's events")
    status, body = secure.get("/ui/apps/web", secure.operator)
    assert status == 200 and 'id="releases"' in body and web["id"] in body, body[-2000:]
    edge = re.search(r'<p id="edge">([^<]*)', body)
    assert edge is not None and not edge.group(1).startswith("0 requests") and "from 1 proxies" in edge.group(1)
    status, body = secure.get(f"/ui/apps/web/machines/{web['id']}", secure.operator)
    assert status == 200 and f"placed on <b>{web['worker_id']}</b>" in body, body[-2000:]
    assert 'id="timeline"' in body and "started" in body
    status, body = secure.get("/ui/jobs", secure.operator)
    assert status == 200 and job_id in body and "succeeded" in body, body[-2000:]
    status, body = secure.get(f"/ui/apps/web/jobs/{job_id}", secure.operator)
    assert status == 200 and 'id="attempts"' in body and "succeeded" in body, body[-2000:]
    status, body = secure.get("/ui/heatmap", secure.operator)
    assert status == 200 and 'class="heatmap"' in body and "mad-w2" in body


def test_the_stream_carries_a_machine_event_and_each_token_acts_as_far_as_it_may(secure: SecureConsole) -> None:
    status, tool = secure.api().call("POST", "/v1/apps/tools/machines", SLEEP)
    assert status == 200, tool
    (web,) = _machines(secure, "web")
    web_id = web["id"]

    deployer = secure.deployer("web")
    assert secure.act("tools", tool["id"], "stop", deployer)[0] == 403  # another app's machine
    status, body = secure.act("web", web_id, "restart", deployer)
    assert status == 200 and body["state"] == "started", body
    status, body = secure.act("web", web_id, "stop", secure.read_only)
    assert status == 403 and "read-only" in body["error"], body

    stream = urllib.request.Request(secure.base + "/ui/stream?app=tools")
    stream.add_header("Authorization", f"Bearer {secure.read_only}")
    with urllib.request.urlopen(stream, timeout=30, context=secure.context) as reply:
        assert reply.readline() == b"retry: 2000\n" and reply.readline() == b"event: hello\n"
        status, body = secure.act("tools", tool["id"], "stop", secure.operator)
        assert status == 200 and body["state"] == "stopped", body
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while "stopped" not in seen:
            assert time.monotonic() < deadline, seen
            line = reply.readline().decode()
            if line == "event: machine\n":
                event = json.loads(reply.readline().decode().split(" ", 1)[1])
                assert event["id"] == tool["id"], event
                seen.append(event["status"])
    status, found = secure.api().call("GET", f"/v1/apps/tools/machines/{tool['id']}")
    assert status == 200 and found["state"] == "stopped"
