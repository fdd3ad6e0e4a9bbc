"""The console's routes under `/ui`, wired into the API's application by `attach`.

Pages answer HTML: 401 (with a link to the login page) for a token that is forged, expired or revoked, 403 for a
token that may not see the app, 404 for an app or machine that does not exist, and a plain-words page for an
error of the fleet (never a stack trace). A request with no token at all is sent to the login page.

Actions (`POST /ui/apps/APP/machines/ID/ACTION`) are answered by the HTTP API's own handlers
(`orchestrator.api.server`) after the same token check a `/v1` write gets, are recorded in the audit stream as
`/v1` writes are, and reply with the machine's state after the action: the real outcome, or the API's error.
Every request that changes anything (an action, logging in or out) must first be the console's own page's:
same origin, the media type the page sends, the session's anti-CSRF token (`guard`), or it is a 403 saying
why, audited as a refused write. Every answer under `/ui` carries the console's security headers (`guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
from aiohttp import web

from bus.contract import subjects
from bus.contract.codec import decoder
from bus.contract.errors import FauxmadError, NotFound
from bus.contract.jobs import JobEvent
from bus.contract.machines import MachineEvent, ResumeRequest, SuspendRequest
from bus.contract.streams import LogLine
from orchestrator.api import server
from orchestrator.api.auth import TRAIL, Auth, Caller, audit, bearer
from orchestrator.api.errors import error_response, from_bus
from orchestrator.api.http import BROKERS, NC, ClientError, app_name, ask, json, machine_id
from orchestrator.console import data, guard, pages
from orchestrator.console.auth import COOKIE, COOKIE_MAX_AGE, Viewer, may_act, presented, viewer
from orchestrator.console.live import Live
from orchestrator.logs import LogRecord
from orchestrator.security.tokens import TokenError

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
KEEPALIVE = 15.0  # seconds between two comments on a quiet event stream
Page = Callable[[web.Request, Viewer], Awaitable[web.StreamResponse]]


class Console:
    def __init__(self, auth: Auth, live: Live, proxy_metrics: list[str], trusted: guard.TrustedProxies) -> None:
        self.auth = auth
        self.live = live
        self.proxy_metrics = proxy_metrics
        self.trusted = trusted
        self.csrf_key = guard.csrf_key(auth.root_key, auth.static_token)
        self.streams: set[asyncio.Task[Any]] = set()

    def csrf(self, request: web.Request) -> str:
        """The anti-CSRF token of the request's session (its cookie)."""
        return guard.csrf_token(self.csrf_key, request.cookies.get(COOKIE, "").strip())

    def refusal(self, request: web.Request, *, wants: str, token: str | None, checked: bool = True) -> str | None:
        """Why this state-changing request is not the console's own page's (`guard.refusal`), or None."""
        seen = guard.asked(request, self.trusted, cookie=COOKIE in request.cookies, bearer=bool(bearer(request)))
        return guard.refusal(seen, wants=wants, token=token, expected=self.csrf(request) if checked else None)

    async def audit_refused(self, request: web.Request, status: int) -> None:
        """Record a refused write, naming the token it carried (its header's, else its cookie's)."""
        caller = Caller("refused", token=self.auth.named(presented(request)))
        await audit(request.app[TRAIL], request, caller, status)


CONSOLE: web.AppKey[Console] = web.AppKey("console", Console)


def html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, status=status, content_type="text/html", headers={"Cache-Control": "no-store"})


def _who(request: web.Request, seen: Viewer) -> pages.Who:
    csrf = request.app[CONSOLE].csrf(request)
    if seen.identity == "anonymous":
        return pages.Who(csrf=csrf)
    scope = f" (app {seen.app})" if seen.app else ""
    return pages.Who(f"{seen.identity}{scope}{' read-only' if seen.read_only else ''}", csrf)


def page(handler: Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`handler` for a viewer whose token is good, with refusals and the fleet's errors as pages."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        console = request.app[CONSOLE]
        text = presented(request)
        if not text and not console.auth.open:
            raise web.HTTPSeeOther(f"/ui/login?next={quote(request.path_qs)}")
        try:
            seen = viewer(console.auth, text)
        except TokenError as exc:
            return html(pages.refused(exc.status, exc.message), exc.status)
        try:
            response = await handler(request, seen)
        except TokenError as exc:
            return html(pages.refused(exc.status, exc.message), exc.status)
        except ClientError as exc:
            if exc.status in (400, 404):
                return html(pages.not_found(exc.message), 404)
            return html(pages.not_found(exc.message), exc.status)
        except NotFound as exc:
            return html(pages.not_found(exc.message), 404)
        except FauxmadError as exc:
            return html(pages.refused(exc.code, f"the fleet did not answer: {exc.message}"), exc.code)
        except Exception as exc:  # a read this API's identity may not make, a stream that is gone: said, not a trace
            log.exception("console: %s", request.path)
            return html(pages.trouble(f"this page could not be read from the fleet: {exc or type(exc).__name__}"), 502)
        if console.live.broken and isinstance(response, web.Response) and response.text:
            response.text = response.text.replace(
                "<main>", f'<main><p class="error">{pages.e(console.live.broken)}</p>', 1
            )
        return response

    return wrapped


def _app(request: web.Request, seen: Viewer) -> str:
    try:
        name = app_name(request)
    except ClientError:
        raise ClientError(404, f"no app named {request.match_info['app_name']!r}") from None
    if not seen.sees(name):
        raise TokenError(f"this token is for app {seen.app} only, not app {name}", 403)
    return name


# ---------------------------------------------------------------------------------------------------
# pages


async def fleet(request: web.Request, seen: Viewer) -> web.StreamResponse:
    live = request.app[CONSOLE].live
    wanted = seen.app or request.query.get("app") or None
    snap = live.snapshot(app=wanted)
    apps = [seen.app] if seen.app else snap.apps
    return html(pages.fleet(snap, app=wanted, apps=apps, who=_who(request, seen)))


async def machine_page(request: web.Request, seen: Viewer) -> web.StreamResponse:
    app = _app(request, seen)
    mid = machine_id(request)
    found = await data.machine(request.app[BROKERS], app, mid)
    logs = await data.logs(request.app[NC], app, mid)
    try:
        may_act(request.app[CONSOLE].auth, seen, app)
        acting = True
    except TokenError:
        acting = False
    body = pages.machine(found, data.kept_explain(found), logs, who=_who(request, seen), may_act=acting)
    return html(body)


async def _app_data(request: web.Request, app: str) -> data.AppData:
    console = request.app[CONSOLE]
    head, releases, recorded = await data.releases(request.app[NC], app)
    snap = console.live.snapshot(app=app)
    if not recorded and not releases and not snap.machines and not console.live.reader.known_app(app):
        raise NotFound(f"app {app} not found: no release and no machine")
    return data.AppData(
        name=app,
        head=head,
        releases=releases,
        progress=data.progress(releases[-1] if releases else None, snap.machines),
        machines=snap.machines,
        edge=await data.edge(console.proxy_metrics, app),
    )


async def app_page(request: web.Request, seen: Viewer) -> web.StreamResponse:
    app = _app(request, seen)
    found = await _app_data(request, app)
    if request.query.get("part") == "live":
        return html(pages.app_live(found))
    return html(pages.app(found, await data.logs(request.app[NC], app), who=_who(request, seen)))


async def jobs_page(request: web.Request, seen: Viewer) -> web.StreamResponse:
    app = seen.app or request.query.get("app") or None
    found = await data.jobs(request.app[NC], app)
    if request.query.get("part") == "live":
        return html(pages.jobs_live(found))
    return html(pages.jobs(found, app=app, who=_who(request, seen)))


async def job_page(request: web.Request, seen: Viewer) -> web.StreamResponse:
    app = _app(request, seen)
    try:
        found = await data.job(request.app[NC], app, request.match_info["job_id"])
    except (NotFound, FauxmadError) as exc:
        raise ClientError(404, f"job {request.match_info['job_id']} of app {app} not found ({exc.message})") from None
    return html(pages.job(found, who=_who(request, seen)))


async def heatmap_page(request: web.Request, seen: Viewer) -> web.StreamResponse:
    live = request.app[CONSOLE].live
    workers = [w.worker_id for w in live.workers() if w.status != "lost"]
    history = list(live.history)
    if request.query.get("part") == "live":
        return html(pages.heatmap_live(history, workers))
    return html(pages.heatmap(history, workers, who=_who(request, seen)))


async def not_found(request: web.Request) -> web.Response:
    return html(pages.not_found(f"nothing at {request.path}"), 404)


# ---------------------------------------------------------------------------------------------------
# logging in


def _next(value: str) -> str:
    return value if value.startswith("/ui/") and "//" not in value else "/ui/"


async def login_form(request: web.Request) -> web.Response:
    return html(pages.login(next_url=_next(request.query.get("next", "/ui/"))))


async def login(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    refused = console.refusal(request, wants=guard.FORM, token=None, checked=False)  # no session yet to bind to
    if refused is not None:
        await console.audit_refused(request, 403)
        return html(pages.refused(403, refused), 403)
    form = await request.post()
    text = str(form.get("token", "")).strip()
    target = _next(str(form.get("next", "/ui/")))
    try:
        viewer(request.app[CONSOLE].auth, text)
    except TokenError as exc:
        return html(pages.login(exc.message, next_url=target), exc.status)
    response = web.HTTPSeeOther(target)
    secure = guard.is_secure(request, console.trusted)  # over TLS, directly or as a trusted proxy says
    response.set_cookie(
        COOKIE, text, max_age=COOKIE_MAX_AGE, path="/ui", httponly=True, samesite="Strict", secure=secure
    )
    raise response


async def logout(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    token = None
    if request.content_type == guard.FORM:
        token = str((await request.post()).get(guard.CSRF_FIELD, ""))
    refused = console.refusal(request, wants=guard.FORM, token=token)
    if refused is not None:
        await console.audit_refused(request, 403)
        return html(pages.refused(403, refused), 403)
    response = web.HTTPSeeOther("/ui/login")
    response.del_cookie(COOKIE, path="/ui", secure=guard.is_secure(request, console.trusted), samesite="Strict")
    raise response


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    path = STATIC / name
    if name not in {p.name for p in STATIC.iterdir()}:
        return html(pages.not_found(f"no file {name}"), 404)
    kind = {".css": "text/css", ".svg": "image/svg+xml"}.get(path.suffix, "text/javascript")
    return web.Response(body=path.read_bytes(), content_type=kind, headers={"Cache-Control": "max-age=300"})


# ---------------------------------------------------------------------------------------------------
# actions


async def _suspend(request: web.Request) -> web.Response:
    await ask(request, "suspend", SuspendRequest(id=machine_id(request)))
    return json({"ok": True})


async def _resume(request: web.Request) -> web.Response:
    await ask(request, "resume", ResumeRequest(id=machine_id(request)))
    return json({"ok": True})


ACTIONS: dict[str, Callable[[web.Request], Awaitable[web.Response]]] = {
    "start": server.start_machine,
    "stop": server.stop_machine,
    "restart": server.restart_machine,
    "suspend": _suspend,
    "resume": _resume,
    "destroy": server.delete_machine,
}


async def act(request: web.Request) -> web.Response:
    console = request.app[CONSOLE]
    action = request.match_info["action"]
    if action not in ACTIONS:
        return error_response(404, f"no action {action!r}: use one of {', '.join(ACTIONS)}")
    refused = console.refusal(request, wants=guard.JSON, token=request.headers.get(guard.CSRF_HEADER))
    if refused is not None:  # before the token is looked at: a forged request learns nothing of it
        await console.audit_refused(request, 403)
        return error_response(403, refused)
    try:
        seen = viewer(console.auth, presented(request))
        app = _app(request, seen)
        mid = machine_id(request)
        may_act(console.auth, seen, app)
    except TokenError as exc:
        await console.audit_refused(request, exc.status)
        return error_response(exc.status, exc.message)
    except ClientError as exc:
        return error_response(exc.status, exc.message)
    caller = Caller(seen.identity, token=seen.identity.removeprefix("token:") if seen.token else "", scope=[])
    try:
        answered = await ACTIONS[action](request)
    except ClientError as exc:
        answered = error_response(exc.status, exc.message, machine_id=exc.machine_id)
    except FauxmadError as exc:
        answered = from_bus(exc)
    await audit(request.app[TRAIL], request, caller, answered.status)
    if answered.status >= 400:
        return answered
    try:
        state = (await data.machine(request.app[BROKERS], app, mid)).state
    except NotFound:
        state = "destroyed"
    return json({"ok": True, "action": action, "machine_id": mid, "state": state})


# ---------------------------------------------------------------------------------------------------
# the event stream


def _event_json(raw: bytes, seen: Viewer) -> bytes | None:
    try:
        event = decoder(MachineEvent).decode(raw)
    except Exception:
        return None
    if not seen.sees(event.app):
        return None
    shown = {
        "id": event.machine_id,
        "app": event.app,
        "region": event.region,
        "worker_id": event.worker_id,
        "type": event.type,
        "status": event.status,
        "from_state": event.from_state,
        "reason": event.reason,
        "timestamp": event.timestamp,
        "href": pages.machine_href(event.app, event.machine_id) if event.app and event.machine_id else "",
        "html": pages.timeline_item(event),
    }
    return msgspec.json.encode(shown)


def _log_json(raw: bytes, seen: Viewer, with_machine: bool) -> bytes | None:
    try:
        line = decoder(LogLine).decode(raw)
    except Exception:
        return None
    if not seen.sees(line.app):
        return None
    return msgspec.json.encode({"html": pages.log_line(LogRecord(0, line), with_machine=with_machine)})


def _job_json(raw: bytes, seen: Viewer) -> bytes | None:
    try:
        event = decoder(JobEvent).decode(raw)
    except Exception:
        return None
    return b"{}" if seen.sees(event.app) else None


def _workers_json(live: Live) -> bytes:
    return msgspec.json.encode(
        [
            {
                "id": w.worker_id,
                "status": w.status,
                "cpu": [w.used.cpus, w.capacity.cpus],
                "mem": [w.used.memory_mb, w.capacity.memory_mb],
            }
            for w in live.workers()
        ]
    )


def _frame(kind: str, raw: bytes, seen: Viewer, live: Live, mid: str | None) -> tuple[str, bytes | None]:
    """What the page is sent for one message: its event name and data (None: nothing)."""
    if kind == "machine":
        return kind, _event_json(raw, seen)
    if kind == "log":
        return kind, _log_json(raw, seen, with_machine=mid is None)
    if kind == "job":
        return kind, _job_json(raw, seen)
    if kind == "release":
        return kind, b"{}"
    if kind == "tick":
        return "workers", _workers_json(live) if mid is None else None
    return kind, b"{}"


def _scope(request: web.Request, console: Console) -> tuple[Viewer, str | None, str | None]:
    """Who asks for a stream, and of which app and machine (`TokenError`, or `BadRequest` for a bad name)."""
    seen = viewer(console.auth, presented(request))
    app = request.query.get("app") or seen.app
    if app is not None:
        subjects.check_token("app", app)
        if not seen.sees(app):
            raise TokenError(f"this token is for app {seen.app} only, not app {app}", 403)
    mid = request.query.get("machine") or None
    if mid is not None:
        subjects.check_token("machine id", mid)
    return seen, app, mid


async def stream(request: web.Request) -> web.StreamResponse:
    """Server-sent events for one page: its machines' events, log lines, job events, and the workers' use."""
    console = request.app[CONSOLE]
    try:
        seen, app, mid = _scope(request, console)
    except TokenError as exc:
        return web.Response(status=exc.status, text=f"{exc.message}; log in at /ui/login\n")
    except FauxmadError as exc:
        return web.Response(status=400, text=f"{exc.message}\n")
    wanted = {"machine": (subjects.EVENTS_STREAM, subjects.events_filter(app, mid))}
    if request.query.get("logs") or mid:
        wanted["log"] = (subjects.LOGS_STREAM, subjects.logs_filter(app, mid))
    if request.query.get("jobs"):
        wanted["job"] = (subjects.JOB_EVENTS_STREAM, subjects.job_events_filter(app))
    if request.query.get("releases") and app is not None:  # a release's status is a key of the apps bucket
        wanted["release"] = (f"KV_{subjects.APPS_BUCKET}", f"$KV.{subjects.APPS_BUCKET}.{app}.>")
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    task = asyncio.current_task()
    assert task is not None
    console.streams.add(task)
    try:
        async with console.live.subscribed(wanted) as queue:

            async def ticks() -> None:
                while True:
                    await console.live.next_tick()
                    queue.put_nowait(("tick", b""))

            ticking = asyncio.create_task(ticks())
            try:
                await response.write(b"retry: 2000\nevent: hello\ndata: {}\n\n")
                while True:
                    try:
                        kind, raw = await asyncio.wait_for(queue.get(), KEEPALIVE)
                    except TimeoutError:
                        await response.write(b": keepalive\n\n")
                        continue
                    kind, out = _frame(kind, raw, seen, console.live, mid)
                    if out is not None:
                        await response.write(b"event: " + kind.encode() + b"\ndata: " + out + b"\n\n")
            finally:
                ticking.cancel()
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        console.streams.discard(task)
    return response


# ---------------------------------------------------------------------------------------------------
# wiring


def attach(
    app: web.Application,
    auth: Auth,
    *,
    proxy_metrics: list[str] | None = None,
    trusted: guard.TrustedProxies | None = None,
) -> None:
    """Serve the console at `/ui` of `app` (the API's application, before it starts); `trusted`: the proxies whose
    `X-Forwarded-Proto` and `X-Forwarded-Host` count (`--trusted-proxy`)."""
    console = Console(auth, Live(app[NC]), list(proxy_metrics or []), trusted or guard.TrustedProxies())
    app[CONSOLE] = console
    app.on_response_prepare.append(guard.add_headers)

    async def start(_: web.Application) -> None:
        await console.live.start()

    async def shutdown(_: web.Application) -> None:
        for task in list(console.streams):  # open pages would hold the listener's shutdown for a minute
            task.cancel()

    async def close(_: web.Application) -> None:
        with contextlib.suppress(Exception):
            await console.live.close()

    app.on_startup.append(start)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(close)
    app.router.add_get("/ui", lambda _: _redirect("/ui/"))
    app.router.add_get("/ui/", page(fleet))
    app.router.add_get("/ui/login", login_form)
    app.router.add_post("/ui/login", login)
    app.router.add_post("/ui/logout", logout)
    app.router.add_get("/ui/static/{name}", static)
    app.router.add_get("/ui/stream", stream)
    app.router.add_get("/ui/jobs", page(jobs_page))
    app.router.add_get("/ui/heatmap", page(heatmap_page))
    app.router.add_get("/ui/apps/{app_name}", page(app_page))
    app.router.add_get("/ui/apps/{app_name}/jobs/{job_id}", page(job_page))
    app.router.add_get("/ui/apps/{app_name}/machines/{machine_id}", page(machine_page))
    app.router.add_post("/ui/apps/{app_name}/machines/{machine_id}/{action}", act)
    app.router.add_route("*", "/ui/{tail:.*}", not_found)


async def _redirect(target: str) -> web.Response:
    raise web.HTTPFound(target)
