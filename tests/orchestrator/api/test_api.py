"""The HTTP Machines API against a real fleet: nats-server, worker and broker processes, an API process."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.local.ports import free_port
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import fleet_fixture, running

SLEEP = {"config": {"init": {"cmd": ["sleep", "300"]}, "guest": {"cpus": 1, "memory_mb": 128}}, "region": "mad"}


class Api:
    def __init__(self, base: str, token: str | None = None, context: ssl.SSLContext | None = None) -> None:
        self.base = base
        self.token = token
        self.context = context  # an https base's: the CA it trusts

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        for key, value in (headers or {}).items():
            req.add_header(key, value)
        try:
            with urllib.request.urlopen(req, timeout=90, context=self.context) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")


def start_api(
    url: str, extra: list[str] | None = None, *, context: ssl.SSLContext | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """An API process and its base URL; `context`: it serves HTTPS (a secure fleet's default), trusting that."""
    port = free_port()
    cmd = [sys.executable, "-m", "orchestrator.cli", "api", "--listen", f"127.0.0.1:{port}", "--nats", url]
    proc = subprocess.Popen([*cmd, *(extra or [])])
    base = f"{'https' if context else 'http'}://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(base + "/openapi.json", timeout=5, context=context):
                return proc, base
        except OSError:
            assert proc.poll() is None, "the API process exited"
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("the API never listened")


fleet = fleet_fixture(FleetSpec(regions=["mad"], workers_per_region=2, cpus=4, memory_mb=4096, brokers=1))


@pytest.fixture(scope="module")
def api(fleet: DevFleet) -> Iterator[Api]:
    proc, base = start_api(fleet.url)
    yield Api(base)
    proc.terminate()
    proc.wait(10)


def test_create_wait_stop_destroy(api: Api) -> None:
    status, machine = api.call("POST", "/v1/apps/web/machines", SLEEP)
    assert status == 200, machine
    assert machine["config"]["init"]["cmd"] == ["sleep", "300"] and machine["region"] == "mad"
    mid = machine["id"]
    path = f"/v1/apps/web/machines/{mid}"
    status, waited = api.call("GET", path + "/wait?state=started&timeout=30")
    assert status == 200 and waited["state"] == "started"
    status, listed = api.call("GET", "/v1/apps/web/machines")
    assert status == 200 and mid in [m["id"] for m in listed]
    status, _ = api.call("POST", path + "/stop", raw=b"")  # a bodyless POST with a JSON content type
    assert status == 200
    status, waited = api.call("GET", path + "/wait?state=stopped&state=destroyed&timeout=30")
    assert status == 200 and waited["state"] == "stopped"
    status, events = api.call("GET", path + "/events")
    assert status == 200 and "stopped" in [e["status"] for e in events]
    status, _ = api.call("DELETE", path + "?force=true")
    assert status == 200
    status, got = api.call("GET", path)
    assert (status == 404 and "error" in got) or got["state"] == "destroyed"


def test_lease_refuses_a_mutation_without_its_nonce(api: Api) -> None:
    status, machine = api.call("POST", "/v1/apps/leased/machines", SLEEP)
    assert status == 200, machine
    path = f"/v1/apps/leased/machines/{machine['id']}"
    status, lease = api.call("POST", path + "/lease", {"ttl": 60, "description": "test"})
    assert status == 200, lease
    nonce = lease["data"]["nonce"]
    assert nonce
    status, refused = api.call("POST", path + "/stop", {})
    assert status in (409, 412) and "leased" in refused["error"]
    status, wrong = api.call("DELETE", path + "?force=true", headers={"fly-machine-lease-nonce": "nope"})
    assert status in (409, 412) and wrong["error"]
    status, got = api.call("GET", path + "/lease")
    assert status == 200 and got["data"]["nonce"] == nonce
    held = {"fly-machine-lease-nonce": nonce}
    status, _ = api.call("POST", path + "/stop", {}, headers=held)
    assert status == 200
    status, _ = api.call("DELETE", path + "/lease", headers=held)
    assert status == 200
    status, _ = api.call("DELETE", path + "?force=true")
    assert status == 200


def test_a_restart_holds_the_machines_lease_from_its_stop_to_its_start(api: Api) -> None:
    """A restart is one action: between its stop and its start nobody else may act on the machine. An operator
    (`reconcile --watch`) that saw it stopped leased it to start it, and the console's restart then got a 409
    ("leased by fauxmad-reconciler@..."). The machine ignores SIGTERM, so the stop lasts its 3 s timeout: once
    its `sleep` runs (exec'd after the trap, so it ignores TERM too). `started` comes before the shell has read its
    trap, and a stop sent sooner ended it at once, too fast for the lease to be seen (a fresh-clone CI run)."""
    token = f"300.{os.getpid()}{threading.get_ident() % 100000}"
    ignores_term = ["sh", "-c", f"trap '' TERM; exec sleep {token}"]
    stubborn = {"config": {"init": {"cmd": ignores_term}, "guest": {"cpus": 1, "memory_mb": 128}}, "region": "mad"}
    status, machine = api.call("POST", "/v1/apps/restarted/machines", stubborn)
    assert status == 200, machine
    path = f"/v1/apps/restarted/machines/{machine['id']}"
    status, waited = api.call("GET", path + "/wait?state=started&timeout=30")
    assert status == 200, waited
    assert eventually(lambda: running(["sleep", token])), "the machine's sleep never ran"
    answer: list[tuple[int, Any]] = []
    restart = threading.Thread(target=lambda: answer.append(api.call("POST", path + "/restart?timeout=3")))
    restart.start()
    try:
        assert eventually(lambda: api.call("GET", path + "/lease")[0] == 200), "the restart took no lease"
        status, lease = api.call("GET", path + "/lease")
        assert status == 200 and lease["data"]["owner"] == "a restart through the API", lease
        status, refused = api.call("POST", path + "/lease", {"ttl": 15, "description": "an operator"})
        assert status in (409, 412) and "leased" in refused["error"], refused
    finally:
        restart.join(60)
    assert answer and answer[0][0] == 200, answer
    status, got = api.call("GET", path)
    assert status == 200 and got["state"] == "started", got
    assert api.call("GET", path + "/lease")[0] == 404  # released at its end
    assert api.call("DELETE", path + "?force=true")[0] == 200


@pytest.mark.parametrize(
    ("method", "path", "raw", "status"),
    [
        ("POST", "/v1/apps/web/machines", b"{not json", 400),
        ("POST", "/v1/apps/web/machines", b'{"config": {}, "region": "mad", "colour": "red"}', 400),
        ("POST", "/v1/apps/web/machines", b'{"config": {"guest": {"cpus": "two"}}, "region": "mad"}', 400),
        ("POST", "/v1/apps/web/machines", b'{"config": {"init": {"cmd": "sleep"}}, "region": "mad"}', 400),
        ("POST", "/v1/apps/web/machines", b'{"config": {}}', 400),
        ("POST", "/v1/apps/web/machines", b'{"config": {"env": {"A=B": "x"}}, "region": "mad"}', 400),
        ("POST", "/v1/apps/web/machines", b'{"config": {"x": "' + b"a" * (2 * 1024 * 1024) + b'"}}', 413),
        ("GET", "/v1/apps/web/machines/not-an-id", None, 404),
        ("GET", "/v1/apps/web/machines/0123456789abcd", None, 404),
        ("GET", "/v1/apps/web/machines/0123456789abcd/wait?timeout=600", None, 400),
        ("GET", "/v1/apps/web/machines/0123456789abcd/wait?state=bogus", None, 400),
        ("GET", "/v1/apps/web/machines/0123456789abcd/wait?timeout=soon", None, 400),
        ("POST", "/v1/apps/web/machines/0123456789abcd/signal", b"{}", 400),
        ("DELETE", "/v1/apps/web/machines/0123456789abcd/lease", None, 400),
        ("GET", "/v1/apps/bad.app/machines", None, 400),
        ("POST", "/v1/apps/bad.app/machines", b"{}", 400),  # a write is audited: its bad app name too (was a 500)
    ],
)
def test_bad_requests_are_4xx_with_the_error_body(
    api: Api, method: str, path: str, raw: bytes | None, status: int
) -> None:
    got, body = api.call(method, path, raw=raw)
    assert got == status, body
    assert isinstance(body, dict) and isinstance(body["error"], str) and body["error"]
    assert body["status"] == "unknown"


def test_no_capacity_is_503_insufficient_capacity(api: Api) -> None:
    huge = {"config": {"init": {"cmd": ["sleep", "1"]}, "guest": {"cpus": 64}}, "region": "mad"}
    status, body = api.call("POST", "/v1/apps/web/machines", huge)
    assert status == 503 and body["status"] == "insufficient_capacity", body


def test_openapi_is_generated_from_the_request_types(api: Api) -> None:
    status, doc = api.call("GET", "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    create = doc["components"]["schemas"]["CreateMachineRequest"]
    assert create["additionalProperties"] is False and "config" in create["properties"]
    assert "/v1/apps/{app_name}/machines/{machine_id}/wait" in doc["paths"]


def test_a_token_file_requires_the_bearer_token(fleet: DevFleet, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    proc, base = start_api(fleet.url, ["--token-file", str(token_file)])
    try:
        status, body = Api(base).call("GET", "/v1/apps/web/machines")
        assert status == 401 and body["error"]
        status, body = Api(base, token="wrong").call("GET", "/v1/apps/web/machines")
        assert status == 401
        status, body = Api(base, token="s3cret-token").call("GET", "/v1/apps/web/machines")
        assert status == 200 and isinstance(body, list)
    finally:
        proc.terminate()
        proc.wait(10)


def test_apps_metadata_and_placements(api: Api) -> None:
    status, created = api.call("POST", "/v1/apps", {"app_name": "meta", "org_slug": "personal"})
    assert status == 201 and created["name"] == "meta"
    status, machine = api.call("POST", "/v1/apps/meta/machines", SLEEP)
    assert status == 200, machine
    path = f"/v1/apps/meta/machines/{machine['id']}"
    status, _ = api.call("POST", path + "/metadata/role", {"value": "primary"})
    assert status == 204
    status, labels = api.call("GET", path + "/metadata")
    assert status == 200 and labels == {"role": "primary"}
    status, got = api.call("GET", path)
    assert got["instance_id"] == machine["instance_id"] and got["state"] == "started"  # relabelled in place
    status, _ = api.call("DELETE", path + "/metadata/role")
    assert status == 204
    assert api.call("GET", path + "/metadata") == (200, {})
    assert api.call("POST", path + "/cordon") == (200, {"ok": True})  # a bodyless POST, as Fly's clients send
    status, labels = api.call("GET", path + "/metadata")
    assert labels == {"fauxmad_cordoned": "true"} and api.call("GET", path)[1]["state"] == "started"
    assert api.call("POST", path + "/uncordon") == (200, {"ok": True})
    assert api.call("GET", path + "/metadata") == (200, {})
    status, bad = api.call("POST", path + "/metadata/bad%20key", {"value": "x"})
    assert status in (400, 404) and bad["error"]
    status, placed = api.call(
        "POST", "/v1/platform/placements", {"compute": {"cpus": 1, "memory_mb": 128}, "count": 3, "region": "mad"}
    )
    assert status == 200, placed
    [mad] = placed["regions"]
    assert mad["region"] == "mad" and mad["count"] == 3 and mad["explain"]["winner"].startswith("mad-")
    status, placed = api.call("POST", "/v1/platform/placements", {"compute": {"cpus": 64}, "count": 1, "region": "mad"})
    assert status == 200 and placed["regions"][0]["count"] == 0
    status, app = api.call("GET", "/v1/apps/meta")
    assert status == 200 and app["name"] == "meta"
    assert eventually(lambda: "meta" in app_names(api))  # apps are read off heartbeats
    status, _ = api.call("DELETE", "/v1/apps/meta")
    assert status == 202
    status, listed = api.call("GET", "/v1/apps/meta/machines")
    assert status == 200 and listed == []
    assert eventually(lambda: "meta" not in app_names(api))


def app_names(api: Api) -> list[str]:
    status, apps = api.call("GET", "/v1/apps")
    assert status == 200 and apps["total_apps"] == len(apps["apps"])
    return [a["name"] for a in apps["apps"]]


def eventually(check: Callable[[], bool], tries: int = 200) -> bool:
    """True once `check` is (the workers' heartbeats carry app counts a moment late), False if never."""
    for _ in range(tries):
        if check():
            return True
        time.sleep(0.05)
    return False


def test_metrics_count_requests_by_route_and_status(fleet: DevFleet) -> None:
    port = free_port()
    proc, base = start_api(fleet.url, ["--metrics-listen", f"127.0.0.1:{port}"])
    try:
        api = Api(base)
        assert api.call("GET", "/v1/apps/web/machines/0123456789abcd")[0] == 404
        assert api.call("GET", "/v1/apps/web/machines")[0] == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        one = 'route="/v1/apps/{app_name}/machines/{machine_id}"'
        assert f'fauxmad_api_requests_total{{method="GET",{one},status="404"}} 1.0' in text, text
        assert 'fauxmad_api_requests_total{method="GET",route="/v1/apps/{app_name}/machines",status="200"} 1.0' in text
        assert "fauxmad_api_request_seconds_bucket" in text
    finally:
        proc.terminate()
        proc.wait(10)


def test_fleet_tokens_are_scoped_expiring_revocable_and_every_write_is_audited(fleet: DevFleet, tmp_path: Path) -> None:
    key = tmp_path / "token.key"
    env = {"FAUXMAD_NATS_URL": fleet.url}

    def cli(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True, env={**os.environ, **env}
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    web = cli("token", "mint", "--key", str(key), "-a", "tokweb", "--ttl", "1h")
    web_read = cli("token", "attenuate", web, "--read-only")
    short = cli("token", "mint", "--key", str(key), "-a", "tokweb", "--ttl", "1s")
    proc, base = start_api(fleet.url, ["--token-key", str(key)])
    try:
        status, machine = Api(base, token=web).call("POST", "/v1/apps/tokweb/machines", SLEEP)
        assert status == 200, machine
        # app A's token cannot touch app B, and nothing happens there
        status, body = Api(base, token=web).call("POST", "/v1/apps/tokother/machines", SLEEP)
        assert status == 403 and "for app tokweb only" in body["error"]
        status, body = Api(base, token=web).call("GET", "/v1/apps/tokother/machines")
        assert status == 403
        assert Api(base).call("GET", "/v1/apps/tokother/machines")[0] == 401
        # read-only: reads work, writes are refused
        assert Api(base, token=web_read).call("GET", "/v1/apps/tokweb/machines")[0] == 200
        path = f"/v1/apps/tokweb/machines/{machine['id']}"
        status, body = Api(base, token=web_read).call("POST", path + "/stop", {})
        assert status == 403 and body["error"] == "this token is read-only"
        # forged (one character of the signature changed), expired, and revoked: 401
        forged = web[:-2] + ("A" if web[-2] != "A" else "B") + web[-1]
        status, body = Api(base, token=forged).call("POST", path + "/stop", {})
        assert status == 401 and "forged" in body["error"]
        time.sleep(max(0.0, 1.1 - (time.time() % 1)) + 1.0)
        status, body = Api(base, token=short).call("POST", path + "/stop", {})
        assert status == 401 and "expired" in body["error"]
        cli("token", "revoke", web_read)  # the narrowed token: it goes, the token it was narrowed from stays
        deadline = time.monotonic() + 10
        while (status := Api(base, token=web_read).call("GET", path)[0]) != 401:  # the API's watch delivers it
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert Api(base, token=web).call("GET", path)[0] == 200
        cli("token", "revoke", web)  # the one it was narrowed from: it goes too, and its descendants stay gone
        deadline = time.monotonic() + 10
        while (status := Api(base, token=web).call("GET", path)[0]) != 401:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        status, body = Api(base, token=web).call("POST", path + "/stop", {})
        assert status == 401 and "revoked" in body["error"]
        assert Api(base, token=web_read).call("GET", path)[0] == 401
        status, body = Api(base).call("POST", path + "/stop", {})  # no token at all
        assert status == 401
        # the machine was never stopped by a refused request
        status, body = Api(base).call("GET", path)
        assert status == 401
    finally:
        proc.terminate()
        proc.wait(10)
    assert _machine_state(fleet.url, "tokweb", machine["id"]) == "started"
    records = _audit(fleet.url)
    by_path = [(r["identity"].split(":")[0], r["method"], r["path"], r["status"]) for r in records]
    assert ("token", "POST", "/v1/apps/tokweb/machines", 200) in by_path
    assert ("refused", "POST", "/v1/apps/tokother/machines", 403) in by_path
    assert ("refused", "POST", path + "/stop", 401) in by_path
    made = next(r for r in records if r["path"] == "/v1/apps/tokweb/machines")
    assert made["scope"][0] == "app = tokweb" and made["app"] == "tokweb"
    # a refused request names the token it carried (its id, as `token inspect` shows it), or that it carried none
    web_id = json.loads(cli("token", "inspect", web, "--json"))["id"]
    refused = {(r["path"], r["status"], r["token"]) for r in records if r["identity"] == "refused"}
    assert ("/v1/apps/tokother/machines", 403, web_id) in refused
    assert (path + "/stop", 401, web_id) in refused  # revoked
    assert (path + "/stop", 401, "none given") in refused
    assert made["token"] == web_id and made["identity"] == f"token:{web_id}"
    assert all(r["method"] != "GET" for r in records)


def _machine_state(url: str, app: str, machine_id: str) -> str:
    from orchestrator.client import FleetClient
    from tests.helpers import arun

    async def main() -> str:
        client = await FleetClient.connect(url)
        try:
            return (await client.get(app, machine_id, events=False)).state
        finally:
            await client.close()

    return arun(main())


def _audit(url: str) -> list[dict[str, Any]]:
    from tests.helpers import arun, connect_nats

    async def main() -> list[dict[str, Any]]:
        nc = await connect_nats(url)
        try:
            js = nc.jetstream()
            sub = await js.subscribe("fauxmad.v1.audit.>", ordered_consumer=True)
            out = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except Exception:
                    return out
                out.append(json.loads(msg.data))
        finally:
            await nc.close()

    return arun(main())


def test_the_readme_token_commands_run_as_written(fleet: DevFleet, tmp_path: Path) -> None:

    section = (
        (Path(__file__).resolve().parents[3] / "docs" / "reference" / "http-api.md")
        .read_text()
        .split("### Tokens and the audit", 1)[1]
    )
    [block] = re.findall(r"```bash\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    key = Path("/tmp/fauxmad-token.key")
    key.unlink(missing_ok=True)
    env = {**os.environ, "FAUXMAD_NATS_URL": fleet.url, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        assert "caveat   access = read" in done.stdout and "revoked token" in done.stdout
        bad = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "token", "attenuate", "fm1_x.y", "--read-only"],
            capture_output=True,
            text=True,
            env=env,
        )
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    finally:
        key.unlink(missing_ok=True)


def curl_calls(block: str) -> set[tuple[str, str]]:
    """(method, path) of each curl in a shell block: `-X M` or GET, the path after `$API` up to `?` or `"`."""
    calls = set()
    for line in block.replace("\\\n", " ").splitlines():
        for call in re.findall(r"curl (.*?)(?:\||$)", line):
            method = re.search(r"-X (\w+)", call)
            (path,) = re.findall(r'"\$API(/[^"?]*)', call)
            calls.add((method.group(1) if method else "GET", path))
    return calls


def test_every_endpoint_has_a_curl_example_that_runs_as_written(fleet: DevFleet) -> None:
    """docs/reference/http-api.md, "Every endpoint with curl": one curl per operation the API serves (its own
    /openapi.json), and the block runs verbatim against a real API (curl -f: any 4xx or 5xx fails it)."""
    from orchestrator.api.openapi import document

    text = (Path(__file__).resolve().parents[3] / "docs" / "reference" / "http-api.md").read_text()
    section = text.split("### Every endpoint with curl", 1)[1].split("\n### ", 1)[0]
    [block] = re.findall(r"```bash\n(.*?)```", section, re.S)
    calls = curl_calls(block)
    served = [
        (method.upper(), path)
        for path, operations in document()["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "delete", "patch")
    ] + [("GET", "/openapi.json"), ("GET", "/docs")]
    for method, path in served:
        pattern = re.compile("^" + re.sub(r"\\\{\w+\\\}", r"[^/]+", re.escape(path)) + "$")
        assert any(m == method and pattern.match(p) for m, p in calls), f"no curl example of {method} {path}"
    proc, base = start_api(fleet.url)
    try:
        env = {**os.environ, "API": base}
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "fauxmad Machines API" in done.stdout
    finally:
        proc.terminate()
        proc.wait(10)
