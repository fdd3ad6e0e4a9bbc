"""Who may call the API, and the audit trail of what they changed.

Two ways to lock the API (`fauxmad api`): a static bearer token from a file (one secret for every
caller, compared in constant time), or tokens minted from the fleet's root key (`--token-key`): app
scoped, expiring, revocable, attenuable (see `orchestrator.security.tokens`). A refused token is a 401
(malformed, forged, expired, revoked) or a 403 (valid, but for another app, or read-only on a write),
with the reason in the error body, and the request goes no further: nothing reaches the brokers.

Revocations live in KV `fauxmad_revoked_tokens`; every API process keeps a replica by a watch, so a
revocation holds on every process within the watch's delay (milliseconds), without a call per request.

Every mutating request (any method but GET and HEAD), allowed or refused, is recorded in the stream
`FAUXMAD_AUDIT` with the identity that made it, after its outcome is known: the record is handed to the
NATS connection before the response goes out, and its stream acknowledgement is awaited beside the
response rather than before it (`AuditTrail`). Waiting for the ack first cost every write 0.85 ms at
p50 (an fsync'd JetStream write) and bought little: a failed audit write is logged either way and never
undoes the change. An API process stopped by SIGTERM or SIGINT waits for its records' acks first
(`AuditTrail.drain`); only a kill -9 in the fraction of a millisecond between a response and the
connection's next write can lose a record.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from bus.contract.streams import AuditRecord
from bus.transport.audit import AuditTrail, audit_subject
from orchestrator.api.errors import error_response
from orchestrator.replicas.replica import KVReplica
from orchestrator.security.tokens import Token, TokenError, decode, verify

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TRAIL: web.AppKey[AuditTrail] = web.AppKey("audit_trail", AuditTrail)  # the web console records its actions here too
READS = frozenset({"GET", "HEAD"})


class RevokedTokens(KVReplica):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def apply(self, key: str, value: bytes | None) -> None:
        if value is None:
            self.ids.discard(key)
        else:
            self.ids.add(key)


class Caller(msgspec.Struct, frozen=True):
    identity: str
    scope: list[str] = []
    token: str = ""  # the id of the token presented (`token inspect` shows it), or NO_TOKEN; "" without tokens


NO_TOKEN = "none given"


def bearer(request: web.Request) -> str:
    """The token of an `Authorization: Bearer` header, "" without one."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


class Auth:
    """What a request must carry: nothing (an open API), the static token, or a token from `root_key`."""

    def __init__(
        self,
        *,
        static_token: bytes | None = None,
        root_key: bytes | None = None,
        revoked: RevokedTokens | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.static_token = static_token
        self.root_key = root_key
        self.revoked = revoked or RevokedTokens()
        self.clock = clock

    @property
    def open(self) -> bool:
        return self.static_token is None and self.root_key is None

    def verify(self, text: str, *, app: str | None, write: bool) -> Token:
        """A minted token checked against this API's root key, clock and revocations (`TokenError` if refused)."""
        if self.root_key is None:
            raise TokenError("missing or wrong bearer token")
        return verify(
            self.root_key, text, app=app, write=write, now=self.clock(), revoked=self.revoked.ids.__contains__
        )

    def presented(self, request: web.Request) -> str:
        """What a refused request's audit record names: the id of the token it carried (as the token says, even
        a forged one), `static-token`, `malformed`, or `none given`."""
        return self.named(bearer(request))

    def named(self, value: str) -> str:
        """What an audit record names for a token's text (see `presented`)."""
        if not value:
            return NO_TOKEN
        if self.static_token is not None and hmac.compare_digest(value.encode(), self.static_token):
            return "static-token"
        try:
            return decode(value).id
        except TokenError:
            return "malformed"

    def identify(self, request: web.Request) -> Caller:
        """The caller of `request`, or `TokenError` saying why it may not make it."""
        if self.open:
            return Caller("anonymous")
        value = bearer(request)
        if not value:
            raise TokenError("missing bearer token (Authorization: Bearer <token>)")
        if self.static_token is not None and hmac.compare_digest(value.encode(), self.static_token):
            return Caller("static-token")
        token = self.verify(value, app=request.match_info.get("app_name"), write=request.method not in READS)
        return Caller(f"token:{token.id}", list(token.caveats), token.id)


async def audit(trail: AuditTrail, request: web.Request, caller: Caller, status: int) -> None:
    """Record one mutating request (allowed or refused) with the identity that made it."""
    app = request.match_info.get("app_name", "")
    record = AuditRecord(
        at=time.time(),
        identity=caller.identity,
        token=caller.token,
        scope=caller.scope,
        method=request.method,
        path=request.path,
        app=app,
        status=status,
        remote=request.remote or "",
        request_id=request.headers.get("fly-request-id", "") or secrets.token_hex(8),
    )
    await trail.record(audit_subject(app), record)  # a malformed app name: refused, recorded as the fleet's


def guard(auth: Auth, trail: AuditTrail) -> Any:
    """The middleware: identify the caller of every `/v1` request, refuse it or run it, audit any write."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/v1/"):
            return await handler(request)
        writes = request.method not in READS
        try:
            caller = auth.identify(request)
        except TokenError as exc:
            if writes:
                await audit(trail, request, Caller("refused", token=auth.presented(request)), exc.status)
            return error_response(exc.status, exc.message)
        response = await handler(request)
        if writes:
            await audit(trail, request, caller, response.status)
        return response

    return middleware
