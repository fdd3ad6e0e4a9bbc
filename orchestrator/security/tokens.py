"""HTTP API tokens: app-scoped, expiring, revocable, and attenuable by whoever holds one (macaroons).

A token is an id, a list of caveats and a signature chained over them with HMAC-SHA256, as in the
macaroons paper (Birgisson et al., 2014) that Fly's tokens follow: `sig0 = HMAC(root_key, id)`, then
`sig_i = HMAC(sig_{i-1}, caveat_i)`. Only the fleet's root key can mint one, but anyone holding a token
can append a caveat and chain the signature on, so a user hands CI a narrower token (one app, read
only, an hour) without asking anyone; no one can remove a caveat, because that would mean going back
up the HMAC chain. Verification recomputes the chain from the root key and then checks every caveat;
an unknown caveat fails closed.

Revocation follows the chain downward only. Every token has its own id, `id_of(signature)`: a one-way hash of
its last signature (`sig_n`), so a token narrowed from another one (same root, more caveats, a later signature)
has an id of its own. Verifying a token recomputes `sig_0 .. sig_n`, which are the signatures of the token and
of every token it was narrowed from, and refuses it if any of their ids is revoked: revoking a token revokes it
and whatever was narrowed from it, never the token it was narrowed from (which shares its root, `root_id`, and
would all go if revocation named the root). The id reveals nothing a forger could use: going from an id back
to its signature would mean inverting SHA-256.

Caveats are plain strings, so a person can read what a token allows (`fauxmad token inspect`):
- `app = NAME`: only that app's paths (several app caveats: the token is good for none but their common app).
- `expires < UNIX_SECONDS`.
- `access = read`: GET only.

Why not a library: pymacaroons (the common Python one) has had no release since 2018, and the part we
need is a dozen lines of `hmac` over bytes; the wire format is ours (`fm1_<payload>.<signature>`, both
base64url), documented in docs/reference/http-api.md. The verifier is a pure function with the clock passed in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

import msgspec

PREFIX = "fm1_"
KEY_BYTES = 32


class TokenError(Exception):
    """Why a token is refused, in plain words. `status` is the HTTP status: 401 (not a valid token for
    anything: malformed, forged, expired, revoked) or 403 (valid, but not for this request)."""

    def __init__(self, message: str, status: int = 401) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Token(msgspec.Struct, frozen=True, kw_only=True):
    root_id: str  # the minted root's random id, shared by every token narrowed from it (`id` on the wire)
    caveats: tuple[str, ...] = ()
    signature: bytes = b""

    def encode(self) -> str:
        payload = msgspec.json.encode({"id": self.root_id, "caveats": list(self.caveats)})
        return f"{PREFIX}{_b64(payload)}.{_b64(self.signature)}"

    @property
    def id(self) -> str:
        """This token's own id: what `token inspect` shows, `token revoke` revokes and the audit names."""
        return id_of(self.signature)

    @property
    def apps(self) -> set[str]:
        return {value for name, value in self.parsed() if name == "app"}

    @property
    def expires(self) -> float | None:
        found = [float(value) for name, value in self.parsed() if name == "expires"]
        return min(found) if found else None

    @property
    def read_only(self) -> bool:
        return ("access", "read") in self.parsed()

    def parsed(self) -> list[tuple[str, str]]:
        return [_parse_caveat(c) for c in self.caveats]


class _Payload(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    caveats: list[str] = []


def new_root_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def caveats_for(*, app: str | None = None, ttl: float | None = None, read_only: bool = False, now: float) -> list[str]:
    out = []
    if app is not None:
        out.append(f"app = {app}")
    if ttl is not None:
        out.append(f"expires < {int(now + ttl)}")
    if read_only:
        out.append("access = read")
    for caveat in out:
        _parse_caveat(caveat)
    return out


def mint(root_key: bytes, caveats: list[str]) -> Token:
    """A new token (a fresh random id) with `caveats`, signed by the fleet's root key."""
    root_id = secrets.token_hex(8)
    return attenuate(Token(root_id=root_id, signature=_mac(root_key, root_id.encode())), caveats)


def attenuate(token: Token, caveats: list[str]) -> Token:
    """`token` narrowed by `caveats`: no key needed, only the token itself."""
    signature = token.signature
    for caveat in caveats:
        _parse_caveat(caveat)
        signature = _mac(signature, caveat.encode())
    return Token(root_id=token.root_id, caveats=(*token.caveats, *caveats), signature=signature)


def decode(text: str) -> Token:
    """Parse a token's text (not yet verified)."""
    text = text.strip()
    if not text.startswith(PREFIX) or text.count(".") != 1:
        raise TokenError("not a fauxmad token (it starts with fm1_ and has one dot)")
    payload, signature = text[len(PREFIX) :].split(".")
    try:
        body = msgspec.json.decode(_unb64(payload), type=_Payload)
        raw_signature = _unb64(signature)
    except (ValueError, msgspec.DecodeError):
        raise TokenError("a malformed token") from None
    if len(raw_signature) != hashlib.sha256().digest_size:
        raise TokenError("a malformed token")
    return Token(root_id=body.id, caveats=tuple(body.caveats), signature=raw_signature)


def verify(
    root_key: bytes,
    text: str,
    *,
    app: str | None,
    write: bool,
    now: float,
    revoked: Callable[[str], bool] = lambda _id: False,
) -> Token:
    """The token in `text` if it allows this request (on `app`, or on no app's path; a write or a read);
    raise `TokenError` saying why not. The signature is checked before anything the token says is read."""
    token = decode(text)
    expected = _mac(root_key, token.root_id.encode())
    chain = [expected]  # the signatures of this token and of every token it was narrowed from
    for caveat in token.caveats:
        expected = _mac(expected, caveat.encode())
        chain.append(expected)
    if not hmac.compare_digest(expected, token.signature):
        raise TokenError("a forged or damaged token (its signature does not match)")
    try:
        parsed = token.parsed()
    except TokenError as exc:
        raise TokenError(f"a token with a caveat this API does not know: {exc.message}") from None
    for signature in reversed(chain):  # downward only: its own id, then the tokens it was narrowed from
        if revoked(id_of(signature)):
            whose = "" if signature == token.signature else f" (it was narrowed from {id_of(signature)}, revoked)"
            raise TokenError(f"token {token.id} has been revoked{whose}")
    expires = token.expires
    if expires is not None and now >= expires:
        raise TokenError(f"token {token.id} expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(expires))}")
    apps = {value for name, value in parsed if name == "app"}
    if apps and (app is None or apps != {app}):
        where = f"app {app}" if app is not None else "paths outside an app"
        raise TokenError(f"this token is for app {', '.join(sorted(apps))} only, not {where}", 403)
    if write and token.read_only:
        raise TokenError("this token is read-only", 403)
    return token


def _parse_caveat(caveat: str) -> tuple[str, str]:
    name, sep, value = caveat.partition(" = ") if " = " in caveat else caveat.partition(" < ")
    name, value = name.strip(), value.strip()
    if not sep or not value:
        raise TokenError(f"caveat {caveat!r} is not `name = value` or `expires < seconds`")
    if name == "app" and sep == " = ":
        return name, value
    if name == "access" and sep == " = " and value == "read":
        return name, value
    if name == "expires" and sep == " < " and value.isdigit():
        return name, value
    raise TokenError(f"unknown caveat {caveat!r}")


def id_of(signature: bytes) -> str:
    """The id of the token whose (last) signature is `signature`: 16 hex digits of a one-way hash."""
    return hashlib.sha256(b"fauxmad token id\0" + signature).hexdigest()[:16]


def _mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
