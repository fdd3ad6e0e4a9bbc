"""The web console (`fauxmad api` at /ui) on a real dev fleet: refusals and 404s over plain HTTP, then Debian's
Chromium driven by Playwright: log in, watch a deploy progress live, read a machine's placement, stop it from
the page, and be refused the same action with a read-only token."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.contract.jobs import JobSubmitRequest
from lab.bench.console import CHROMIUM, CHROMIUM_ARGS
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.jobs.client import JobsClient
from orchestrator.security.tokens import caveats_for, mint, new_root_key
from tests.helpers import ROOT, arun, audit_records, connect_nats, wait_until
from tests.orchestrator import proxy_kit as kit
from tests.orchestrator.api.test_api import Api, start_api

SLEEP = {"config": {"init": {"cmd": ["sleep", "300"]}, "guest": {"cpus": 1, "memory_mb": 128}}, "region": "mad"}


class Console:
    def __init__(self, fleet: DevFleet, base: str, key: bytes, context: ssl.SSLContext | None = None) -> None:
        self.fleet = fleet
        self.base = base
        self.context = context  # an https base's: the CA it trusts
        self.operator = mint(key, []).encode()
        self.read_only = mint(key, caveats_for(read_only=True, now=time.time())).encode()
        self.expired = mint(key, caveats_for(ttl=-60, now=time.time())).encode()
        self.forged = mint(new_root_key(), []).encode()
        self.key = key

    def deployer(self, app: str) -> str:
        return mint(self.key, caveats_for(app=app, now=time.time())).encode()

    def get(self, path: str, token: str | None, *, cookie: bool = False) -> tuple[int, str]:
        request = urllib.request.Request(self.base + path)
        if token is not None:
            request.add_header(
                *(("Cookie", f"fauxmad_console={token}") if cookie else ("Authorization", f"Bearer {token}"))
            )
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def api(self) -> Api:
        return Api(self.base, self.operator, self.context)

    def act(self, app: str, machine_id: str, action: str, token: str) -> tuple[int, Any]:
        """A machine's action as the page's button sends it: status and JSON answer."""
        path = f"{self.base}/ui/apps/{app}/machines/{machine_id}/{action}"
        request = urllib.request.Request(path, data=b"{}", method="POST")
        request.add_header("Authorization", f"Bearer {token}")
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=60, context=self.context) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    key = new_root_key()
    key_file = tmp_path_factory.mktemp("console") / "token.key"
    key_file.write_bytes(key)
    spec = FleetSpec(regions=["mad", "syd"], workers_per_region=2, cpus=4, memory_mb=4096, brokers=1)
    with DevFleet(spec) as fleet:
        proc, base = start_api(fleet.url, ["--token-key", str(key_file)])
        try:
            yield Console(fleet, base, key)
        finally:
            proc.terminate()
            proc.wait(10)


def test_a_forged_or_expired_token_is_401_on_pages_and_on_the_event_stream(console: Console) -> None:
    for token in (console.forged, console.expired, "fm1_e30.AAAA"):
        for path in ("/ui/", "/ui/apps/web", "/ui/stream", "/ui/stream?app=web"):
            for cookie in (False, True):
                status, body = console.get(path, token, cookie=cookie)
                assert status == 401, (path, token, status, body)
                assert "/ui/login" in body and "Traceback" not in body
    status, body = console.get("/ui/", console.expired)
    assert "expired" in body
    assert console.get("/ui/", console.operator)[0] == 200


def test_an_unknown_app_or_machine_is_a_404_page(console: Console) -> None:
    status, created = console.api().call("POST", "/v1/apps/known/machines", SLEEP)
    assert status == 200, created
    for path in (
        "/ui/apps/nothing-here",
        "/ui/apps/known/machines/0123456789abcd",
        "/ui/apps/known/machines/not-a-machine",
        "/ui/apps/bad%20name",
        "/ui/no/such/page",
    ):
        status, body = console.get(path, console.operator)
        assert status == 404 and "<h1>Not found</h1>" in body and "Traceback" not in body, (path, status, body)
    assert console.get(f"/ui/apps/known/machines/{created['id']}", console.operator)[0] == 200


def contrast(one: str, two: str) -> float:
    """WCAG's contrast ratio of two colours, `#rrggbb` or `rgb(r, g, b)`."""

    def luminance(colour: str) -> float:
        if colour.startswith("#"):
            parts = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
        else:
            parts = [int(float(x)) for x in re.findall(r"[\d.]+", colour)[:3]]
        linear = [c / 255 / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in parts]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted((luminance(one), luminance(two)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def test_a_machines_buttons_follow_its_state_and_the_page_has_its_icon(console: Console) -> None:
    """Over plain HTTP: a started machine's page offers stop, restart, suspend and destroy, not start or resume
    (issue 41: every button was enabled whatever the state); the page's icon answers (a browser asked
    /favicon.ico, a 404); the live status is inside the page's margin (<main>); the bars' labels read on their
    fill (WCAG's 4.5:1)."""
    status, created = console.api().call("POST", "/v1/apps/buttons/machines", SLEEP)
    assert status == 200 and created["state"] == "started", created
    status, page = console.get(f"/ui/apps/buttons/machines/{created['id']}", console.operator)
    assert status == 200, page
    buttons = dict(re.findall(r'<button type="button" data-action="(\w+)"[^>]*?( disabled)?>', page))
    assert buttons == {
        "start": " disabled",
        "stop": "",
        "restart": "",
        "suspend": "",
        "resume": " disabled",
        "destroy": "",
    }
    assert console.api().call("POST", f"/v1/apps/buttons/machines/{created['id']}/stop", {})[0] == 200
    wait_until(
        lambda: console.api().call("GET", f"/v1/apps/buttons/machines/{created['id']}")[1]["state"] == "stopped",
        "stopped",
    )
    page = console.get(f"/ui/apps/buttons/machines/{created['id']}", console.operator)[1]
    buttons = dict(re.findall(r'<button type="button" data-action="(\w+)"[^>]*?( disabled)?>', page))
    assert buttons == {
        "start": "",
        "stop": " disabled",
        "restart": "",
        "suspend": " disabled",
        "resume": " disabled",
        "destroy": "",
    }
    (icon,) = re.findall(r'<link rel="icon" href="([^"]+)"', page)
    request = urllib.request.Request(console.base + icon)
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("image/svg+xml")
    assert re.search(r'<main>.*<p id="live-status"[^>]*></p></main>', page, re.S), page[-300:]
    css = (ROOT / "orchestrator" / "console" / "static" / "console.css").read_text()
    (fill,) = re.findall(r"\.bar rect \{ fill: (#[0-9a-f]{6}); \}", css)
    (label,) = re.findall(r"\.bar em \{[^}]*[^-]color: (#[0-9a-f]{3,6});", css)
    label = label if len(label) == 7 else "#" + "".join(c * 2 for c in label[1:])
    assert contrast(fill, label) >= 4.5, (fill, label)


def _deploy_spec(tmp_path: Path) -> Path:
    spec = tmp_path / "fauxmad.toml"
    spec.write_text(
        'app = "live"\ncmd = ["sleep", "300"]\n[guest]\ncpus = 1\nmemory_mb = 128\n[regions]\nmad = 2\nsyd = 1\n'
    )
    return spec


def _fauxmad(console: Console, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, FAUXMAD_NATS_URL=console.fleet.url, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(ROOT),
    )


def _log_in(page: Any, console: Console, token: str, target: str = "/ui/") -> None:
    page.goto(console.base + target)
    page.fill("#token", token)
    page.click("#login")
    page.wait_for_selector("body[data-live='1']")  # the page's event stream is open


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)")
def test_in_a_browser_a_deploy_goes_live_a_machine_explains_itself_and_stops(console: Console, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    status, record = console.api().call("POST", "/v1/apps", {"app_name": "live", "org_slug": "personal"})
    assert status == 201, record
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(30_000)
            missing: list[str] = []  # every resource a page asked for answered (issue 41: one was a 404)
            page.on("response", lambda r: missing.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            _log_in(page, console, console.operator, "/ui/apps/live")
            assert page.url.endswith("/ui/apps/live")
            assert page.locator("#progress").count() == 0  # no release yet: no deploy to show
            page.evaluate(
                """() => { window.__kept = true; window.__seen = new Set();
                new MutationObserver(() => { const t = document.getElementById('progress');
                  if (t) window.__seen.add(t.innerText); }).observe(document.body, {subtree: true, childList: true}); }"""
            )
            deploy = _fauxmad(console, "deploy", "-c", str(_deploy_spec(tmp_path)))
            page.wait_for_function(
                """() => { const r = document.querySelector('#releases tr:nth-child(2)');
                const p = document.getElementById('progress');
                return r && r.innerText.includes('complete') && p && p.innerText.includes('2/2')
                  && p.innerText.includes('1/1'); }"""
            )
            out, _ = deploy.communicate(timeout=60)
            assert deploy.returncode == 0, out
            assert page.evaluate("window.__kept === true")  # the page was never reloaded: it went live
            assert page.evaluate("window.__seen.size") >= 1  # the deploy's table appeared on the open page

            # the fleet page shows the app's machines; one opens its page
            page.goto(console.base + "/ui/?app=live")
            page.wait_for_selector("body[data-live='1']")
            label, track, fill = page.evaluate(
                """() => { const bar = document.querySelector('.bar'); const get = (el, p) => getComputedStyle(el)[p];
                return [get(bar.querySelector('em'), 'color'), get(bar, 'backgroundColor'),
                  get(bar.querySelector('rect'), 'fill')]; }"""
            )
            assert contrast(label, fill) >= 4.5 and contrast(label, track) >= 4.5, (label, fill, track)
            live, heading = page.evaluate(
                """() => [document.getElementById('live-status').getBoundingClientRect().left,
                document.querySelector('main h1, main h2').getBoundingClientRect().left]"""
            )
            assert live == heading, (live, heading)  # "live" in the page's margin, as its text
            chip = page.locator("a.m.s-started").first
            machine_id = chip.get_attribute("data-machine")
            chip.click()
            page.wait_for_selector("body[data-live='1']")
            status, machine = console.api().call("GET", f"/v1/apps/live/machines/{machine_id}")
            assert status == 200
            summary = page.inner_text("#explain-summary")
            assert f"placed on {machine['worker_id']}" in summary, summary
            chart = page.locator("svg.explain").text_content() or ""
            assert machine["worker_id"] + " ✓" in chart  # the winner, among the candidates with their subscores
            assert page.locator("svg.explain rect title").count() >= 2

            # its buttons follow its state: a started machine is not started or resumed again
            assert page.is_disabled("button[data-action=start]") and page.is_disabled("button[data-action=resume]")
            assert page.is_enabled("button[data-action=stop]") and page.is_enabled("button[data-action=suspend]")

            # stop it from the page: the page says the real outcome and its state changes
            page.click("button[data-action=stop]")
            page.wait_for_function("() => document.getElementById('state').textContent === 'stopped'")
            page.wait_for_function("() => !document.querySelector('button[data-action=start]').disabled")
            assert page.is_disabled("button[data-action=stop]") and page.is_disabled("button[data-action=suspend]")
            assert not missing, missing
            assert "the machine is stopped" in page.inner_text("#outcome")
            page.wait_for_function("() => document.getElementById('timeline').innerText.includes('stopping → stopped')")
            assert console.api().call("GET", f"/v1/apps/live/machines/{machine_id}")[1]["state"] == "stopped"

            # a read-only token sees the same page and is refused the action
            reader = browser.new_context().new_page()
            reader.set_default_timeout(30_000)
            _log_in(reader, console, console.read_only, f"/ui/apps/live/machines/{machine_id}")
            reader.click("button[data-action=start]")
            reader.wait_for_function("() => document.getElementById('outcome').innerText.includes('refused')")
            assert "403" in reader.inner_text("#outcome") and "read-only" in reader.inner_text("#outcome")
            assert console.api().call("GET", f"/v1/apps/live/machines/{machine_id}")[1]["state"] == "stopped"
        finally:
            browser.close()


def test_the_login_cookie_is_http_only_and_same_site_strict(console: Console) -> None:
    data = urllib.parse.urlencode({"token": console.read_only, "next": "/ui/jobs"}).encode()
    request = urllib.request.Request(console.base + "/ui/login", data=data, method="POST")
    request.add_header("Origin", console.base)  # as the login page's form sends it (another origin: a 403)

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    try:
        urllib.request.build_opener(NoRedirect).open(request, timeout=30)
        raise AssertionError("a login answers with a redirect")
    except urllib.error.HTTPError as err:
        assert err.code == 303 and err.headers["Location"] == "/ui/jobs"
        cookie = err.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ui" in cookie
    assert json.dumps(console.read_only)[1:-1] in cookie


@pytest.mark.fleet  # starts processes of its own
def test_the_how_to_block_runs_as_written(console: Console, tmp_path: Path) -> None:
    """docs/how-to/console.md: mint tokens, serve the console on its default port, a 200, a 401, and a 403 for the
    operator's cookie sent from another origin."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "how-to" / "console.md").read_text(), re.S)
    assert len(blocks) == 1, blocks
    env = dict(os.environ, FAUXMAD_NATS_URL=console.fleet.url, PYTHONPATH=str(ROOT))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", blocks[0]], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    codes = [line for line in done.stdout.splitlines() if line.isdigit()]  # the api's own line is on stdout too
    assert codes == ["200", "401", "403"], done.stdout + done.stderr
    assert (tmp_path / "web-reader.token").read_text().startswith("fm1_")


def test_a_deployers_token_sees_its_app_only_and_the_jobs_and_heatmap_pages_answer(console: Console) -> None:
    key_scoped = console.deployer("scoped")
    status, made = console.api().call("POST", "/v1/apps/scoped/machines", SLEEP)
    assert status == 200, made
    status, body = console.get("/ui/", key_scoped)
    assert status == 200 and made["id"] in body
    assert 'href="/ui/apps/known/' not in body  # another app's machines are not shown
    status, body = console.get("/ui/apps/known", key_scoped)
    assert status == 403 and "scoped only" in body
    assert console.get("/ui/stream?app=known", key_scoped)[0] == 403

    job = _fauxmad(console, "job", "submit", "-a", "scoped", "-r", "mad", "--wait", "--", "echo", "made")
    out, _ = job.communicate(timeout=60)
    assert job.returncode == 0, out
    status, body = console.get("/ui/jobs", key_scoped)
    assert status == 200 and "succeeded" in body, body
    job_id = re.search(r"/ui/apps/scoped/jobs/(j[0-9a-f]{15})", body)
    assert job_id is not None, body
    status, body = console.get(f"/ui/apps/scoped/jobs/{job_id.group(1)}", key_scoped)
    assert status == 200 and 'id="attempts"' in body and "succeeded" in body

    status, body = console.get("/ui/heatmap", console.operator)
    assert status == 200 and 'class="heatmap"' in body and "mad-w1" in body


def test_the_jobs_page_lists_queued_jobs_that_have_no_record_yet(console: Console) -> None:
    """A queued job has no record until a worker takes it (issue 44): the jobs page reads the work queues too.
    More jobs than mad's slots (2 workers x 4 cpus) stay queued; without the queues' read they were missing."""

    async def submit() -> list[str]:
        jobs = JobsClient(await connect_nats(console.fleet.url))
        try:
            request = JobSubmitRequest(app="queuedjobs", cmd=["sleep", "60"], count=14, runner="process")
            return [job.id for job in await jobs.submit("mad", request)]
        finally:
            await jobs.close()

    async def cancel(ids: list[str]) -> None:
        jobs = JobsClient(await connect_nats(console.fleet.url))
        try:
            for job_id in ids:
                await jobs.cancel("queuedjobs", job_id)
        finally:
            await jobs.close()

    ids = arun(submit())
    try:
        status, body = console.get("/ui/jobs?app=queuedjobs", console.operator)
        assert status == 200, body
        assert all(job_id in body for job_id in ids), body
        assert 'class="j-queued"' in body, body
    finally:
        arun(cancel(ids))


def test_actions_answer_their_real_outcome_and_are_audited(console: Console) -> None:
    status, made = console.api().call("POST", "/v1/apps/audited/machines", SLEEP)
    assert status == 200, made
    path = f"/ui/apps/audited/machines/{made['id']}"

    status, body = console.act("audited", made["id"], "stop", console.read_only)
    assert status == 403 and "read-only" in body["error"]
    status, body = console.act("audited", made["id"], "stop", console.operator)
    assert status == 200 and body["state"] == "stopped", body
    # a stopped machine cannot be suspended: the worker's answer
    status, body = console.act("audited", made["id"], "suspend", console.operator)
    assert status >= 400 and body["error"], body
    status, body = console.act("audited", made["id"], "destroy", console.operator)
    assert status == 200 and body["state"] == "destroyed", body

    async def records() -> list[Any]:
        nc = await connect_nats(console.fleet.url)
        try:
            return await audit_records(nc, "audited")
        finally:
            await nc.close()

    seen = [(r.path, r.status, r.identity) for r in arun(records()) if r.path.startswith("/ui/")]
    assert (f"{path}/stop", 403, "refused") in seen
    assert [s for p, s, who in seen if p == f"{path}/stop" and who.startswith("token:")] == [200]
    assert [s for p, s, _ in seen if p == f"{path}/destroy"] == [200]


def test_a_pages_stream_carries_its_apps_events_and_log_lines_as_they_happen(console: Console) -> None:
    stream = urllib.request.Request(console.base + "/ui/stream?app=chatty&logs=1")
    stream.add_header("Authorization", f"Bearer {console.read_only}")
    with urllib.request.urlopen(stream, timeout=30) as reply:
        assert reply.headers["Content-Type"].startswith("text/event-stream")
        assert reply.readline() == b"retry: 2000\n" and reply.readline() == b"event: hello\n"
        loud = {**SLEEP, "config": {**SLEEP["config"], "init": {"cmd": ["sh", "-c", "echo hello-console; sleep 300"]}}}
        status, made = console.api().call("POST", "/v1/apps/chatty/machines", loud)
        assert status == 200, made
        kinds: dict[str, list[Any]] = {}
        deadline = time.monotonic() + 20
        while not ("log" in kinds and "started" in {e["status"] for e in kinds.get("machine", [])}):
            assert time.monotonic() < deadline, kinds
            line = reply.readline().decode()
            if line.startswith("event: "):
                kind = line.split(" ", 1)[1].strip()
                data = json.loads(reply.readline().decode().split(" ", 1)[1])
                kinds.setdefault(kind, []).append(data)
    assert {e["id"] for e in kinds["machine"]} == {made["id"]}
    assert any("hello-console" in line["html"] for line in kinds["log"])


def test_the_fleet_page_marks_a_cordoned_worker(console: Console) -> None:
    async def cordon(cordoned: bool) -> None:
        client = await FleetClient.connect(console.fleet.url, "console-test")
        try:
            await client.cordon("syd-w2", cordoned=cordoned)
        finally:
            await client.close()

    arun(cordon(True))
    try:
        wait_until(
            lambda: 'class="worker w-cordoned" data-worker="syd-w2"' in console.get("/ui/", console.operator)[1],
            "the fleet page marks syd-w2 cordoned",
            timeout=20,
            interval=0.3,
        )
    finally:
        arun(cordon(False))


@pytest.mark.fleet  # starts processes of its own
def test_the_app_page_shows_the_edges_numbers_from_a_real_proxy(console: Console, tmp_path: Path) -> None:
    proxy = kit.ProxyProcess(console.fleet.url, "mad", tmp_path)
    api_proc, base = start_api(console.fleet.url, ["--proxy-metrics", f"http://127.0.0.1:{proxy.admin}/metrics"])
    try:
        spec = kit.spec_for("edgy", {"mad": 1}, "auto_start = true\n")
        release = arun(kit.publish(console.fleet.url, spec))
        arun(kit.machines(console.fleet.url, spec, release, [("mad", True)]))
        for _ in range(3):
            assert arun(kit.get(proxy.port, "edgy.localhost")).status == 200
        with urllib.request.urlopen(base + "/ui/apps/edgy", timeout=30) as reply:
            page = reply.read().decode()
        edge = re.search(r'<p id="edge">([^<]*)', page)
        assert edge is not None and edge.group(1).startswith("3 requests (0 5xx)"), page[-2000:]
        assert "from 1 proxies" in edge.group(1)
    finally:
        api_proc.terminate()
        api_proc.wait(10)
        proxy.stop()


def test_the_fleet_page_marks_a_lost_worker(console: Console) -> None:
    """A worker that stops beating (SIGSTOP: alive, silent) is marked lost once its heartbeat is older than the
    TTL, and ready again once it beats; the region counts it."""
    (proc,) = [p for name, p in console.fleet.processes if name == "worker-syd-w1" and p.poll() is None]
    mark = 'class="worker w-lost" data-worker="syd-w1"'
    assert 'data-worker="syd-w1"' in console.get("/ui/", console.operator)[1]
    assert mark not in console.get("/ui/", console.operator)[1]
    proc.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: mark in console.get("/ui/", console.operator)[1], "syd-w1 marked lost", timeout=30)
        body = console.get("/ui/", console.operator)[1]
        assert '<span class="badge lost">lost</span>' in body and "1 lost" in body
    finally:
        proc.send_signal(signal.SIGCONT)
    wait_until(
        lambda: 'class="worker w-ready" data-worker="syd-w1"' in console.get("/ui/", console.operator)[1],
        "syd-w1 ready again once it beats",
        timeout=30,
    )
