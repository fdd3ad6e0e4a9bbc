"""Who is looking at the console: the API's tokens, carried in a cookie (set by the login page) or a header.

The same rules as the HTTP API (`orchestrator.api.auth.Auth`): an open API lets anyone see and act; a static
token sees and acts on everything; a minted token is checked by `orchestrator.security.tokens.verify` with the
app of the page, a read for a page and a write for an action. A token scoped to one app sees only that app.
The cookie is HttpOnly (no script reads it) and SameSite=Strict (no other site's page can post with it).
"""

from __future__ import annotations

import hmac

import msgspec
from aiohttp import web

from orchestrator.api.auth import Auth, bearer
from orchestrator.security.tokens import TokenError, decode

COOKIE = "fauxmad_console"
COOKIE_MAX_AGE = 12 * 3600


class Viewer(msgspec.Struct, frozen=True, kw_only=True):
    """A caller whose token was accepted for reading: `app` is the one app it is scoped to (None: all)."""

    identity: str
    app: str | None = None
    read_only: bool = False
    token: str = ""  # the token's text, for the write check of an action

    def sees(self, app: str) -> bool:
        return self.app is None or self.app == app


def presented(request: web.Request) -> str:
    """The token a request carries: its `Authorization: Bearer` header first, else the console's cookie."""
    return bearer(request) or request.cookies.get(COOKIE, "").strip()


def viewer(auth: Auth, text: str) -> Viewer:
    """The viewer `text` makes, or `TokenError` (401: no valid token; 403: valid for nothing this console shows)."""
    if auth.open:
        return Viewer(identity="anonymous")
    if not text:
        raise TokenError("no token: log in with one (`fauxmad token mint` makes them)")
    if auth.static_token is not None and hmac.compare_digest(text.encode(), auth.static_token):
        return Viewer(identity="static-token", token=text)
    if auth.root_key is None:
        raise TokenError("wrong token")
    apps = decode(text).apps
    app = next(iter(apps)) if len(apps) == 1 else None
    token = auth.verify(text, app=app, write=False)
    return Viewer(identity=f"token:{token.id}", app=app, read_only=token.read_only, token=text)


def may_act(auth: Auth, seen: Viewer, app: str) -> None:
    """Raise `TokenError` (403) unless `seen` may change machines of `app`."""
    if auth.open or seen.identity == "static-token":
        return
    if auth.root_key is None:
        raise TokenError("wrong token")
    auth.verify(seen.token, app=app, write=True)
