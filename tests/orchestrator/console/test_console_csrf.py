"""The console refuses every state-changing request that is not its own page's (issue 38), on a real dev fleet and
a real `fauxmad api`: over plain HTTP (a foreign Origin, no anti-CSRF token, text/plain: each a 403 saying why,
audited, the machine untouched; the page's own request acts), the security headers on every answer, the cookie
`Secure` exactly when the request came over TLS (directly, or from a `--trusted-proxy`), and Debian's Chromium
driven by Playwright: attacker pages on 127.0.0.1 and on localhost at another port try a no-cors fetch, an
auto-submitted form and a frame, and get nothing, while the console's own Stop button works."""

from __future__ import annotations

import http.client
import http.server
import json
import re
import socketserver
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bus.local.ports import free_port
from lab.bench.console import CHROMIUM, CHROMIUM_ARGS
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.security import pki
from orchestrator.security.tokens import caveats_for, mint, new_root_key
from tests.helpers import arun, audit_records, connect_nats, wait_until

SLEEP = {"config": {"init": {"cmd": ["sleep", "300"]}, "guest": {"cpus": 1, "memory_mb": 64}}, "region": "mad"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
PROXY = "127.0.0.2"  # the API's --trusted-proxy: this test's requests come from it when they play the proxy


class Reply:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self) -> str:
        return self.body.decode()

    def error(self) -> str:
        return str(json.loads(self.body)["error"])


class Api:
    """One `fauxmad api` process: its base URL, and requests to it with every header under the test's control."""

    def __init__(self, proc: subprocess.Popen[bytes], base: str, context: ssl.SSLContext | None = None) -> None:
        self.proc = proc
        self.base = base
        self.context = context
        parts = urllib.parse.urlsplit(base)
        self.host, self.port = parts.hostname or "", parts.port or 0

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        source: str | None = None,
    ) -> Reply:
        address = (source, 0) if source else None
        conn: http.client.HTTPConnection
        if self.context is not None:
            conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=60, context=self.context, source_address=address
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=60, source_address=address)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            reply = conn.getresponse()
            return Reply(reply.status, reply.headers, reply.read())
        finally:
            conn.close()

    def v1(self, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        reply = self.request(method, path, headers=headers, body=data)
        return reply.status, json.loads(reply.body or b"null")

    def log_in(self, token: str, **request: Any) -> Reply:
        """The login page's form, posted as the browser posts it from the page (Origin: the console)."""
        headers = {"Origin": self.base, "Content-Type": "application/x-www-form-urlencoded"}
        headers.update(request.pop("headers", {}))
        form = urllib.parse.urlencode({"token": token, "next": "/ui/"}).encode()
        return self.request("POST", "/ui/login", headers=headers, body=form, **request)


def start(url: str, extra: list[str], context: ssl.SSLContext | None = None) -> Api:
    port = free_port()
    cmd = [sys.executable, "-m", "orchestrator.cli", "api", "--listen", f"127.0.0.1:{port}", "--nats", url, *extra]
    api = Api(subprocess.Popen(cmd), f"{'https' if context else 'http'}://127.0.0.1:{port}", context)

    def answers() -> bool:
        assert api.proc.poll() is None, "the API process exited"
        try:
            return api.request("GET", "/openapi.json").status == 200
        except OSError:
            return False

    wait_until(answers, "the API listens", timeout=30, interval=0.05)
    return api


class Setting:
    def __init__(self, fleet: DevFleet, plain: Api, tls: Api, key: bytes) -> None:
        self.fleet = fleet
        self.plain = plain
        self.tls = tls
        self.operator = mint(key, []).encode()
        self.key = key

    def machine(self, app: str) -> str:
        status, made = self.plain.v1("POST", f"/v1/apps/{app}/machines", self.operator, SLEEP)
        assert status == 200, made
        return str(made["id"])

    def state(self, app: str, mid: str) -> str:
        status, found = self.plain.v1("GET", f"/v1/apps/{app}/machines/{mid}", self.operator)
        assert status == 200, found
        return str(found["state"])

    def refused(self, app: str) -> list[tuple[str, int]]:
        """The paths and statuses of `app`'s audit records of refused requests."""
        return [(path, status) for path, status, who in self.audited(app) if who == "refused"]

    def audited(self, app: str) -> list[tuple[str, int, str]]:
        """The path, status and identity of each of `app`'s audit records of the console's (not /v1) requests."""

        async def read() -> list[Any]:
            nc = await connect_nats(self.fleet.url)
            try:
                return await audit_records(nc, app)
            finally:
                await nc.close()

        with ThreadPoolExecutor(1) as thread:  # its own event loop: Playwright's sync API runs one in this thread
            records = thread.submit(lambda: arun(read())).result()
        return [(r.path, r.status, r.identity) for r in records if r.path.startswith("/ui/")]


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setting]:
    here = tmp_path_factory.mktemp("console-csrf")
    key = new_root_key()
    (here / "token.key").write_bytes(key)
    ca = pki.make_ca()
    pki.write_cert(here / "ca.pem", ca[0])
    cert, cert_key = pki.issue(ca, "console", server_names=["127.0.0.1", "localhost"], client=False)
    pki.write_cert(here / "console.pem", cert)
    pki.write_key(here / "console-key.pem", cert_key)
    context = ssl.create_default_context(cafile=str(here / "ca.pem"))
    spec = FleetSpec(regions=["mad"], workers_per_region=1, cpus=8, memory_mb=4096, brokers=1)
    with DevFleet(spec) as fleet:
        keyed = ["--token-key", str(here / "token.key")]
        plain = start(fleet.url, [*keyed, "--trusted-proxy", PROXY])
        try:
            tls = start(
                fleet.url,
                [*keyed, "--tls-cert", str(here / "console.pem"), "--tls-key", str(here / "console-key.pem")],
                context,
            )
            try:
                yield Setting(fleet, plain, tls, key)
            finally:
                tls.proc.terminate()
                tls.proc.wait(10)
        finally:
            plain.proc.terminate()
            plain.proc.wait(10)


def _cookie(reply: Reply) -> str:
    assert reply.status == 303, (reply.status, reply.text)
    return reply.headers["Set-Cookie"]


def _session(api: Api, token: str, path: str) -> tuple[str, str]:
    """Log in through the form; the cookie header it set and the anti-CSRF token of the page at `path`."""
    set_cookie = _cookie(api.log_in(token))
    cookie = set_cookie.split(";", 1)[0]
    page = api.request("GET", path, headers={"Cookie": cookie})
    assert page.status == 200, page.text[-500:]
    found = re.search(r'<meta name="fauxmad-csrf" content="([^"]+)">', page.text)
    assert found is not None, page.text[:500]
    return cookie, found.group(1)


# ---------------------------------------------------------------------------------------------------
# plain HTTP


def test_a_forged_request_is_refused_saying_why_audited_and_changes_nothing(setting: Setting) -> None:
    api = setting.plain
    mid = setting.machine("forged")
    path = f"/ui/apps/forged/machines/{mid}/stop"
    cookie, csrf = _session(api, setting.operator, f"/ui/apps/forged/machines/{mid}")
    own = {"Cookie": cookie, "Origin": api.base, "Content-Type": "application/json", "X-Fauxmad-Csrf": csrf}
    other_port = f"http://127.0.0.1:{free_port()}"
    tries = {
        "a foreign origin": ({**own, "Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}, "cross-site"),
        "another port": ({**own, "Origin": other_port}, f"origin {other_port} may not act"),
        "another port, same site": ({**own, "Origin": other_port, "Sec-Fetch-Site": "same-site"}, "same-site"),
        "no token": ({k: v for k, v in own.items() if k != "X-Fauxmad-Csrf"}, "no anti-CSRF token"),
        "another session's token": ({**own, "X-Fauxmad-Csrf": "A" * 43}, "wrong anti-CSRF token"),
        "text/plain": ({**own, "Content-Type": "text/plain"}, "Content-Type text/plain refused"),
        "no Origin": ({k: v for k, v in own.items() if k != "Origin"}, "without an Origin header"),
    }
    for what, (headers, said) in tries.items():
        reply = api.request("POST", path, headers=headers, body=b"{}")
        assert reply.status == 403 and said in reply.error(), (what, reply.status, reply.text)
        assert "\n" not in reply.error()
    destroy = api.request("POST", path.replace("/stop", "/destroy?force=true"), headers={**own, "Origin": "null"})
    assert destroy.status == 403 and "origin null" in destroy.error(), destroy.text
    assert setting.state("forged", mid) == "started"
    wait_until(
        lambda: [s for p, s in setting.refused("forged") if p == path] == [403] * len(tries),
        "every refusal is in the audit trail",
        timeout=10,
        interval=0.2,
    )

    # the page's own request, as its script sends it: acts
    reply = api.request("POST", path, headers={**own, "Sec-Fetch-Site": "same-origin"}, body=b"{}")
    assert reply.status == 200 and json.loads(reply.body)["state"] == "stopped", reply.text
    assert setting.state("forged", mid) == "stopped"

    # a script with its token and no cookie needs no Origin nor anti-CSRF token, but the media type still
    bearer = {"Authorization": f"Bearer {setting.operator}"}
    start_path = path.replace("/stop", "/start")
    reply = api.request("POST", start_path, headers={**bearer, "Content-Type": "text/plain"}, body=b"{}")
    assert reply.status == 403 and "text/plain" in reply.error()
    reply = api.request("POST", start_path, headers={**bearer, "Content-Type": "application/json"}, body=b"{}")
    assert reply.status == 200 and json.loads(reply.body)["state"] == "started", reply.text


def test_logging_in_and_out_are_the_pages_own_or_refused(setting: Setting) -> None:
    api = setting.plain
    foreign = api.log_in(setting.operator, headers={"Origin": f"http://localhost:{api.port}"})
    assert foreign.status == 403 and "Set-Cookie" not in foreign.headers
    assert f"origin http://localhost:{api.port} may not act" in foreign.text
    cookie, csrf = _session(api, setting.operator, "/ui/")
    form = {"Cookie": cookie, "Origin": api.base, "Content-Type": "application/x-www-form-urlencoded"}
    refused = api.request("POST", "/ui/logout", headers=form, body=b"csrf=wrong")
    assert refused.status == 403 and "wrong anti-CSRF token" in refused.text and "Set-Cookie" not in refused.headers
    done = api.request("POST", "/ui/logout", headers=form, body=urllib.parse.urlencode({"csrf": csrf}).encode())
    assert done.status == 303 and done.headers["Location"] == "/ui/login"
    assert 'fauxmad_console=""' in done.headers["Set-Cookie"]


def test_every_console_answer_carries_the_security_headers(setting: Setting) -> None:
    api = setting.plain
    mid = setting.machine("headers")
    cookie, _ = _session(api, setting.operator, "/ui/")
    deployer = mint(setting.key, caveats_for(app="other", now=time.time())).encode()
    seen = {"Cookie": cookie}
    paths = [
        "/ui",
        "/ui/",
        "/ui/?app=headers",
        "/ui/apps/headers",
        "/ui/apps/headers?part=live",
        f"/ui/apps/headers/machines/{mid}",
        "/ui/jobs",
        "/ui/jobs?part=live",
        "/ui/heatmap",
        "/ui/heatmap?part=live",
        "/ui/login",
        "/ui/static/console.js",
        "/ui/static/console.css",
        "/ui/static/nothing.js",
        "/ui/no/such/page",
        "/ui/apps/nothing-here",
    ]
    answered: dict[int, int] = {}
    for path in paths:
        reply = api.request("GET", path, headers=seen)
        answered[reply.status] = answered.get(reply.status, 0) + 1
        for name, value in HEADERS.items():
            assert reply.headers[name] == value, (path, name, reply.headers[name])
        if reply.headers["Content-Type"].startswith("text/html"):  # nothing the policy would block
            assert " style=" not in reply.text and not re.search(r"<script(?![^>]*\bsrc=)", reply.text), path
    assert answered == {200: 12, 302: 1, 404: 3}, answered
    others = [
        api.request("GET", "/ui/", headers={"Authorization": "Bearer fm1_e30.AAAA"}),  # 401
        api.request("GET", "/ui/apps/headers", headers={"Authorization": f"Bearer {deployer}"}),  # 403
        api.request("GET", "/ui/"),  # 303 to the login page
        api.request("POST", "/ui/logout", headers={"Origin": "http://evil.example"}),  # 403, refused
        api.request("POST", f"/ui/apps/headers/machines/{mid}/stop", headers={"Origin": "http://evil.example"}),
    ]
    assert [r.status for r in others] == [401, 403, 303, 403, 403]
    for reply in others:
        assert all(reply.headers[name] == value for name, value in HEADERS.items()), reply.headers

    # the event stream: its headers, then its first event
    conn = http.client.HTTPConnection(api.host, api.port, timeout=30)
    try:
        conn.request("GET", "/ui/stream?app=headers", headers=seen)
        stream = conn.getresponse()
        assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
        assert all(stream.headers[name] == value for name, value in HEADERS.items()), stream.headers
        assert stream.readline() == b"retry: 2000\n"
    finally:
        conn.close()


def test_the_cookie_is_secure_exactly_when_the_request_came_over_tls(setting: Setting) -> None:
    plain, tls = setting.plain, setting.tls
    https = {"X-Forwarded-Proto": "https"}
    assert "Secure" not in _cookie(plain.log_in(setting.operator))
    assert "Secure" not in _cookie(plain.log_in(setting.operator, source=PROXY))  # the proxy says nothing
    # from the trusted proxy: believed; the browser's origin is then https://
    behind = plain.log_in(
        setting.operator, source=PROXY, headers={**https, "Origin": f"https://127.0.0.1:{plain.port}"}
    )
    assert "; Secure" in _cookie(behind)
    # from anyone else: ignored, both for the cookie and for the origin it makes
    assert "Secure" not in _cookie(plain.log_in(setting.operator, headers=https))
    spoofed = plain.log_in(setting.operator, headers={**https, "Origin": f"https://127.0.0.1:{plain.port}"})
    assert spoofed.status == 403 and f"this console is http://127.0.0.1:{plain.port}" in spoofed.text
    # a trusted proxy's X-Forwarded-Host names the origin the browser saw; nobody else's does
    named = {**https, "X-Forwarded-Host": "console.example", "Origin": "https://console.example"}
    assert "; Secure" in _cookie(plain.log_in(setting.operator, source=PROXY, headers=named))
    assert plain.log_in(setting.operator, headers=named).status == 403

    # directly over TLS (--tls-cert/--tls-key): Secure, and the pages answer over it
    assert "; Secure" in _cookie(tls.log_in(setting.operator))
    cookie, csrf = _session(tls, setting.operator, "/ui/")
    mid = setting.machine("tls")
    own = {"Cookie": cookie, "Origin": tls.base, "Content-Type": "application/json", "X-Fauxmad-Csrf": csrf}
    http_origin = tls.request("POST", f"/ui/apps/tls/machines/{mid}/stop", headers={**own, "Origin": plain.base})
    assert http_origin.status == 403
    reply = tls.request("POST", f"/ui/apps/tls/machines/{mid}/stop", headers=own, body=b"{}")
    assert reply.status == 200 and json.loads(reply.body)["state"] == "stopped", reply.text


@pytest.mark.fleet  # starts processes of its own
def test_bad_tls_options_are_one_line(setting: Setting, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "orchestrator.cli", "api", "--listen", "127.0.0.1:0", "--nats", setting.fleet.url]
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    cases = {
        ("--tls-cert", str(tmp_path / "junk.pem")): "--tls-cert and --tls-key go together",
        ("--tls-cert", str(tmp_path / "junk.pem"), "--tls-key", str(tmp_path / "junk.pem")): "are not a certificate",
        ("--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(tmp_path / "none.pem")): "no such file",
        ("--trusted-proxy", "proxy.example"): "--trusted-proxy 'proxy.example' is not an IP address or a CIDR",
    }
    for args, said in cases.items():
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr, (args, done.returncode, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


# ---------------------------------------------------------------------------------------------------
# in a browser

ATTACK = """<!doctype html><html><body>
<iframe id="framed" name="framed" src="CONSOLE/ui/" width="600" height="300"></iframe>
<iframe name="sink" width="10" height="10"></iframe>
<form id="forged" method="post" action="CONSOLE/ui/apps/APP/machines/ID/destroy?force=true" target="sink">
<input type="hidden" name="x" value="1"></form>
<script>
(async () => {
  const stop = "CONSOLE/ui/apps/APP/machines/ID/stop";
  await fetch(stop, {method: "POST", mode: "no-cors", credentials: "include", body: "{}"}).catch(() => {});
  await fetch(stop, {method: "POST", mode: "no-cors", credentials: "include", body: "{}",
                     headers: {"Content-Type": "text/plain"}}).catch(() => {});
  document.getElementById("forged").submit();
  document.title = "sent";
})();
</script></body></html>"""


class AttackPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        assert isinstance(self.server, AttackPages)
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.server.page)))
        self.end_headers()
        self.wfile.write(self.server.page)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class AttackPages(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """A page of another origin on the console's own host (a machine's app could serve it), at another port."""

    daemon_threads = True

    def __init__(self, page: str) -> None:
        self.page = page.encode()
        super().__init__(("127.0.0.1", 0), AttackPage)


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)")
def test_in_a_browser_pages_of_other_origins_on_the_same_host_can_neither_act_nor_frame(setting: Setting) -> None:
    from playwright.sync_api import sync_playwright

    api = setting.plain
    mid = setting.machine("victim")
    page_text = ATTACK.replace("CONSOLE", api.base).replace("APP", "victim").replace("ID", mid)
    attacker = AttackPages(page_text)
    served = threading.Thread(target=attacker.serve_forever, daemon=True)
    served.start()
    port = attacker.server_address[1]
    actions = [f"/ui/apps/victim/machines/{mid}/stop", f"/ui/apps/victim/machines/{mid}/destroy"]
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                context = browser.new_context()
                page = context.new_page()
                page.set_default_timeout(30_000)
                page.goto(api.base + f"/ui/apps/victim/machines/{mid}")
                page.fill("#token", setting.operator)
                page.click("#login")
                page.wait_for_selector("body[data-live='1']")
                assert page.url == api.base + f"/ui/apps/victim/machines/{mid}"  # not left on the login page
                assert context.cookies()[0]["name"] == "fauxmad_console"

                for n, origin in enumerate((f"http://127.0.0.1:{port}", f"http://localhost:{port}"), start=1):
                    evil = context.new_page()
                    evil.set_default_timeout(30_000)
                    evil.goto(origin + "/attack.html")
                    evil.wait_for_function("() => document.title === 'sent'")
                    wait_until(  # each forged request reached the console (and was refused: below)
                        lambda n=n: len(setting.audited("victim")) >= 3 * n,
                        f"the console got the three requests of the page at {origin}",
                        timeout=20,
                        interval=0.3,
                    )
                    assert setting.state("victim", mid) == "started", origin
                    assert [who for _, _, who in setting.audited("victim")] == ["refused"] * 3 * n
                    framed = evil.frame(name="framed")
                    assert framed is not None
                    assert framed.url != api.base + "/ui/", framed.url  # the browser would not show it
                    assert "Heatmap" not in framed.content() and "log in" not in framed.content()
                    evil.close()
                refused = setting.refused("victim")
                assert sorted(refused) == sorted([(actions[0], 403)] * 4 + [(actions[1], 403)] * 2), refused

                # the console's own button still acts
                page.click("button[data-action=stop]")
                page.wait_for_function("() => document.getElementById('state').textContent === 'stopped'")
                # the outcome is the stop's own answer, which may come after the events stream showed the state
                page.wait_for_function("() => document.getElementById('outcome').textContent.endsWith('…') === false")
                assert "the machine is stopped" in page.inner_text("#outcome")
                assert setting.state("victim", mid) == "stopped"
                page.click("header button[type=submit]")  # log out: the form sends its session's token
                page.wait_for_url(api.base + "/ui/login")
                assert context.cookies() == []
            finally:
                browser.close()
    finally:
        attacker.shutdown()
        attacker.server_close()
