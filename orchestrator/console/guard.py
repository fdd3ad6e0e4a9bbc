"""Same-origin or refused: what a state-changing request of the console must show, and the headers every answer
of the console carries.

Why: the console's cookie is sent with any request the operator's browser makes to the console's host, whatever
page asked for it. SameSite=Strict does not stop a page on another port of the same host (a machine's app on
`localhost:$PORT`): another port is the same *site*, so a `fetch(..., {mode: "no-cors", credentials: "include"})`
or an auto-submitted form from it carried the cookie and acted as the operator. So a request that changes
anything (`POST` under `/ui`) must pass, in this order:

1. `Sec-Fetch-Site`, when the browser sends it, is `same-origin` (not `same-site`: that is another port).
2. `Origin` is the console's own origin, scheme://host:port, as the request was addressed (its `Host` header,
   and the scheme it came over: TLS, or a trusted proxy's `X-Forwarded-Proto`; another port is another
   origin). Every current browser sends `Origin` on a POST; a request without one is refused unless the browser
   said `Sec-Fetch-Site: same-origin`.
3. Its `Content-Type` is exactly what the console's page sends there: `application/json` for an action, the
   form encoding for logging in and out. A `text/plain` body is what a cross-site page may send without asking
   (no CORS preflight), so it is refused even where the other checks would pass.
4. It carries the anti-CSRF token of its session (`X-Fauxmad-Csrf` header, or the form's `csrf` field): an HMAC
   of the session's cookie with a key only the API holds (`csrf_key`), put in each page it renders; another
   origin cannot read the page, so cannot learn it.

A client that authenticates with `Authorization: Bearer` and sends no cookie is not a browser riding a session:
a page of another origin cannot add that header without a CORS preflight, which this API never allows. Such a
client skips 1, 2 and 4 (scripts keep working with their token alone), but not 3. Logging in has no session yet
to bind a token to: it is checked by 1 to 3.

`X-Forwarded-Proto` and `X-Forwarded-Host` count only from a peer named by `--trusted-proxy` (an IP or a CIDR);
from anyone else they are ignored, so a client cannot make the cookie `Secure`-less or an origin its own by
saying so. Of a comma-separated list the last value counts: the one the trusted proxy itself wrote.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Iterable
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

CSRF_HEADER = "X-Fauxmad-Csrf"
CSRF_FIELD = "csrf"
JSON = "application/json"
FORM = "application/x-www-form-urlencoded"
DEFAULT_PORTS = {"http": 80, "https": 443}

# every answer under /ui: no inline script or style is needed (the console has none), no page may frame it
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The peers whose `X-Forwarded-Proto` and `X-Forwarded-Host` are believed (`--trusted-proxy`)."""

    def __init__(self, networks: Iterable[Network] = ()) -> None:
        self.networks = list(networks)

    def __contains__(self, peer: str | None) -> bool:
        if not peer or not self.networks:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:  # a Unix socket's peer, or nothing an IP network can hold
            return False
        return any(address in network for network in self.networks)


def parse_proxy(value: str) -> Network:
    """`--trusted-proxy`'s value (an IP or a CIDR), or `ValueError` saying what is wrong with it."""
    try:
        return ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ValueError(f"--trusted-proxy {value!r} is not an IP address or a CIDR (such as 10.0.0.0/8)") from None


TRUSTED: web.AppKey[TrustedProxies] = web.AppKey("trusted_proxies", TrustedProxies)


def forwarded(request: web.BaseRequest, header: str, trusted: TrustedProxies) -> str | None:
    """The value of a forwarding header, if the peer that sent it is a trusted proxy (else None)."""
    value = request.headers.get(header)
    if value is None or request.remote not in trusted:
        return None
    last = value.split(",")[-1].strip()
    return last or None


def is_secure(request: web.BaseRequest, trusted: TrustedProxies) -> bool:
    """Whether the request came over TLS: to this listener directly, or to a trusted proxy that says so."""
    if request.secure:
        return True
    return (forwarded(request, "X-Forwarded-Proto", trusted) or "").lower() == "https"


def normal_origin(scheme: str, host: str) -> str | None:
    """scheme://host:port in one spelling (lower case, the scheme's default port left out), None if malformed."""
    try:
        parts = urlsplit(f"{scheme.lower()}://{host}")
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.path or parts.query or parts.username:
        return None
    name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    shown = "" if port is None or port == DEFAULT_PORTS[parts.scheme] else f":{port}"
    return f"{parts.scheme}://{name.lower()}{shown}"


def own_origin(request: web.BaseRequest, trusted: TrustedProxies) -> str | None:
    """The console's origin as this request addressed it: its scheme and its `Host` (a trusted proxy's
    `X-Forwarded-Host` instead, when it sends one)."""
    scheme = "https" if is_secure(request, trusted) else "http"
    host = forwarded(request, "X-Forwarded-Host", trusted) or request.headers.get("Host") or ""
    return normal_origin(scheme, host)


def given_origin(value: str) -> str | None:
    """An `Origin` header in the same spelling as `own_origin` (None: `null` or malformed)."""
    scheme, sep, rest = value.strip().partition("://")
    return normal_origin(scheme, rest) if sep else None


class Asked(msgspec.Struct, frozen=True, kw_only=True):
    """What a state-changing request shows of where it comes from (the headers `refusal` reads)."""

    own: str | None  # the console's origin as this request addressed it
    origin: str | None = None  # its Origin header, as sent
    fetch_site: str | None = None  # its Sec-Fetch-Site header
    content_type: str = ""  # its media type, without parameters
    bearer_only: bool = False  # Authorization: Bearer and no cookie: a script with its token, not a session


def asked(request: web.BaseRequest, trusted: TrustedProxies, *, cookie: bool, bearer: bool) -> Asked:
    return Asked(
        own=own_origin(request, trusted),
        origin=request.headers.get("Origin"),
        fetch_site=request.headers.get("Sec-Fetch-Site"),
        content_type=request.content_type if "Content-Type" in request.headers else "",
        bearer_only=bearer and not cookie,
    )


def refusal(seen: Asked, *, wants: str, token: str | None, expected: str | None) -> str | None:
    """Why the request is refused (one line), or None. `wants`: the one media type this route takes; `token`:
    the anti-CSRF token it carried; `expected`: its session's (None: this route checks none, as logging in)."""
    if not seen.bearer_only:
        if seen.fetch_site is not None and seen.fetch_site.lower() != "same-origin":
            return (
                f"a {seen.fetch_site} request may not act (Sec-Fetch-Site: {seen.fetch_site}): "
                "only the console's own pages may"
            )
        if seen.origin is not None:
            origin = given_origin(seen.origin)
            if origin is None or origin != seen.own:
                return f"a request from origin {seen.origin} may not act: this console is {seen.own or 'unknown'}"
        elif seen.fetch_site is None:
            return (
                "a request without an Origin header may not act with the console's cookie: "
                "send Authorization: Bearer TOKEN instead"
            )
    if seen.content_type != wants:
        return f"Content-Type {seen.content_type or 'none'} refused: this takes {wants}"
    if seen.bearer_only or expected is None:
        return None
    if not token:
        return f"no anti-CSRF token: the console's page sends it ({CSRF_HEADER}); reload the page"
    if not hmac.compare_digest(token.encode(), expected.encode()):
        return "wrong anti-CSRF token (another session's, or the page is older than this login): reload the page"
    return None


def csrf_key(root_key: bytes | None, static_token: bytes | None) -> bytes:
    """The key the anti-CSRF tokens are made with: derived from the API's secret, so every API process of a fleet
    makes the same token for a session (a page served by one is accepted by another), or random per process for an
    open API (which has no secret)."""
    secret = root_key or static_token
    if secret is None:
        return secrets.token_bytes(32)
    return hmac.new(secret, b"fauxmad console anti-CSRF key", hashlib.sha256).digest()


def csrf_token(key: bytes, session: str) -> str:
    """The anti-CSRF token of a session (its cookie's value; "" for an open API's visitor)."""
    digest = hmac.new(key, b"session\x00" + session.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


async def add_headers(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """The console's headers, on every answer under `/ui` (pages, partials, the event stream, static files,
    refusals and redirects alike): an `on_response_prepare` signal."""
    if request.path == "/ui" or request.path.startswith("/ui/"):
        response.headers.update(HEADERS)
