"""The audit trail, and who made a request that came over NATS.

NATS tells a subscriber nothing about who published a message: the server authenticated the connection (its
nkey, in a secure fleet), but a broker answering `fauxmad.v1.api.apps.<app>.machines.<verb>` sees only the
subject, the payload and the headers. So a client with an nkey identity signs its API requests, and the broker
that answers a mutating one checks the signature and records the request, with that identity, in the stream
`FAUXMAD_AUDIT` (`AuditTrail`: the same trail the HTTP API writes).

The signature: ed25519 by the identity's nkey (the seed it connects with) over the subject, the signing time,
the name the identity gives itself, and the SHA-256 of the payload; in the headers
`Fauxmad-Identity` (the public key, `U...`), `Fauxmad-Signed-At` (Unix milliseconds), `Fauxmad-Name` and
`Fauxmad-Signature` (base64url). A broker refuses (403) a request whose signature does not verify or whose
signing time is more than `MAX_SKEW` away from its own clock, so a signed request cannot be altered, sent
under another key, or replayed later than that. The public key is the identity (the one the server
authenticated, as the fleet's `users.conf` lists it); the name is what the key's holder calls itself.

A request without a signature is recorded as `unsigned`: an open fleet's clients, and any client of the
documented subjects that does not sign. Why not the server's own `Nats-Request-Info` header: nats-server adds
it only on a service imported from another account with `share`, which would put the fleet's users in an
account of their own, every JetStream read of theirs behind an import; the signature needs no server setup.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bus.contract import subjects
from bus.contract.errors import BadRequest, Forbidden
from bus.contract.streams import AuditRecord, UploadOutcome
from bus.transport.jsfast import ReplyInbox, ack_problem
from bus.transport.nats_adapter import Msg, Nats, signer_of
from bus.transport.signing import (
    IDENTITY_HEADER,
    NAME_HEADER,
    SIGNATURE_HEADER,
    SIGNED_AT_HEADER,
    signed_bytes,
)

log = logging.getLogger(__name__)

MAX_SKEW = 60.0  # seconds a signing time may be off the broker's clock
AUDIT_TIMEOUT = 2.0  # seconds an audit record's JetStream ack is awaited (in the background)

# the verbs that change nothing (every other verb on the API subjects is recorded)
READ_VERBS = frozenset({"list", "get", "wait", "snapshots", "simulate", "status"})


class Caller(msgspec.Struct, frozen=True):
    identity: str  # "nkey:<public key>", "unsigned" or "refused"
    name: str = ""


UNSIGNED = Caller("unsigned")
REFUSED = Caller("refused")  # a signature that does not verify: the request went no further

# who made the request being answered (set by `bus.transport.service.Responder` before its handler runs): for a
# handler whose work ends after its reply, as an image upload opened by a push does, to record its end as theirs
CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("fauxmad_caller", default=UNSIGNED)


def current_caller() -> Caller:
    return CALLER.get()


class Carrier:
    """A mutating request's audit record, offered to its handler: one whose change has a durable record of its
    own on the bus (a create: the machine's `created` event) keeps the audit record there (`carry_audit`), and
    the responder then records nothing more for its success. A failure is recorded in the trail as ever."""

    __slots__ = ("carried", "record")

    def __init__(self, record: AuditRecord) -> None:
        self.record = record
        self.carried = False


# set by `bus.transport.service.Responder` for each audited request (its task's own context)
CARRIER: contextvars.ContextVar[Carrier | None] = contextvars.ContextVar("fauxmad_audit_carrier", default=None)


def audit_to_carry() -> AuditRecord | None:
    """The audit record of the request being answered, for the handler to keep in its change's own durable record
    (None: this request is not audited here, as a broker embedded in the HTTP API, whose requests the API audits).
    The handler calls `carried()` once that record is committed."""
    carrier = CARRIER.get()
    return None if carrier is None else carrier.record


def carried() -> None:
    """The request's audit record is in its change's own durable record: its success needs no trail record."""
    carrier = CARRIER.get()
    if carrier is not None:
        carrier.carried = True


def identify(subject: str, data: bytes, headers: dict[str, str] | None, now: float) -> Caller:
    """Who signed this request (`UNSIGNED` when nobody did), or `Forbidden` saying why the signature fails."""
    found = headers or {}
    public_key = found.get(IDENTITY_HEADER)
    if public_key is None:
        return UNSIGNED
    signed_at = found.get(SIGNED_AT_HEADER, "")
    name = found.get(NAME_HEADER, "")
    try:
        signature = base64.urlsafe_b64decode(found.get(SIGNATURE_HEADER, "").encode())
        _verify_key(public_key).verify(signed_bytes(subject, signed_at, name, data), signature)
        at = int(signed_at) / 1000
    except Exception:  # a malformed key, signature or time, or a signature of something else
        raise Forbidden(f"request signature of {public_key[:12]}... does not verify") from None
    if abs(now - at) > MAX_SKEW:
        raise Forbidden(f"request signed {now - at:.0f}s ago: more than {MAX_SKEW:g}s off this broker's clock")
    return Caller(f"nkey:{public_key}", name)


def _verify_key(public_key: str) -> Any:
    """The ed25519 key of a user's public nkey (`U` + base32 of prefix, key, CRC-16), or ValueError."""
    import nacl.signing
    import nkeys

    raw = base64.b32decode(public_key.encode())
    if len(raw) != 35 or raw[0] != nkeys.PREFIX_BYTE_USER:
        raise ValueError("not a user's public nkey")
    if nkeys.crc16(bytearray(raw[:-2])) != int.from_bytes(raw[-2:], "little"):
        raise ValueError("the public nkey's checksum is wrong")
    return nacl.signing.VerifyKey(raw[1:33])


API_SUBJECTS = f"{subjects.PREFIX}.api."


def mutating(subject: str) -> bool:
    """Whether a request is an API request that changes something (and so is signed and recorded)."""
    # a region's own create (`...machines.create.<region>`) ends in its region, which may be named like a read verb
    return subject.startswith(API_SUBJECTS) and (
        subject.rpartition(".")[2] not in READ_VERBS or subject.rpartition(".")[0].endswith(".machines.create")
    )


class AuditTrail:
    """Publishes audit records to JetStream and collects their acks in the background: a record is on the wire
    when `record` returns, a failure (now or at its ack) is logged and never undoes the change, and `drain`
    waits for the acks of everything recorded so far (a process stopping by a signal calls it).

    Every mutating request records one, so the acks cost no task, future or timer each (nats-py's
    `publish_async` and a waiting task cost about as much CPU as the rest of a create at the broker): one
    reply subscription, replies `<inbox>.<n>` counting up, the records awaiting an ack in sending order with
    their deadlines, and one timer for the oldest."""

    def __init__(self, nc: Nats) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._inbox = ReplyInbox(nc, self._on_ack)  # subscribed at the first record
        self._waiting: dict[str, tuple[str, float]] = {}  # reply token -> (what, deadline); oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._acked = asyncio.Event()  # set while nothing awaits an ack
        self._acked.set()

    @property
    def pending(self) -> int:
        """Records published whose ack has neither come nor been given up on."""
        return len(self._waiting)

    async def make_stream_if_open(self) -> None:
        """On an open fleet, make the audit stream if it is not there (a secure fleet's operator makes it:
        `fauxmad fleet prepare`). Without it requests are still answered, and each record's failure logged."""
        if signer_of(self.nc) is not None:
            return
        from bus.transport.jetstream import ensure_audit_stream

        try:
            await ensure_audit_stream(self.js)
        except Exception as exc:
            log.warning("the audit stream is not there and could not be made (%s): records will fail", exc)

    async def record(self, subject: str, record: AuditRecord) -> None:
        try:
            await self._inbox.start()
            token = self._inbox.token()
            await self._inbox.publish(subject, msgspec.json.encode(record), token)
        except Exception as exc:
            log.error("audit: could not record %s: %s", _what(record), exc)
            return
        loop = asyncio.get_running_loop()
        self._waiting[token] = (_what(record), loop.time() + AUDIT_TIMEOUT)
        self._acked.clear()
        if self._timer is None:
            self._timer = loop.call_later(AUDIT_TIMEOUT, self._expire)

    def _on_ack(self, token: str, msg: Msg) -> None:
        waited = self._waiting.pop(token, None)
        if waited is None:
            return  # given up on already (logged then)
        problem = ack_problem(msg)
        if problem is not None:
            log.error("audit: %s was not acknowledged: %s", waited[0], problem)
        if not self._waiting:
            self._acked.set()

    def _expire(self) -> None:
        """The oldest records' deadlines passed: log them, and wait for the next oldest."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._waiting:
            token, (what, deadline) = next(iter(self._waiting.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire)
                return
            del self._waiting[token]
            log.error("audit: %s was not acknowledged: no ack within %gs", what, AUDIT_TIMEOUT)
        self._acked.set()

    async def drain(self, timeout: float = AUDIT_TIMEOUT) -> None:
        """Wait (at most `timeout`) for the acks of every record published so far."""
        if not self._acked.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._acked.wait(), timeout)


def _what(record: AuditRecord) -> str:
    return f"{record.method} {record.path} by {record.identity}"


def audit_subject(app: str | None) -> str:
    """The record's subject: its app's, or `_fleet` for none (or a name too malformed to be one)."""
    try:
        return subjects.audit(app or None)
    except BadRequest:
        return subjects.audit(None)


class RequestAudit:
    """What a service (a broker) does with its API requests: identify the signer before the handler runs and
    record every mutating request, allowed or refused, once its outcome is known."""

    def __init__(self, trail: AuditTrail, clock: Callable[[], float] = time.time) -> None:
        self.trail = trail
        self.clock = clock

    def identify(self, subject: str, data: bytes, headers: dict[str, str] | None) -> Caller:
        return identify(subject, data, headers, self.clock())

    def carrier(self, subject: str, caller: Caller, request_id: str = "") -> Carrier:
        """The record of this request's success, for a handler to carry (`audit_to_carry`)."""
        app = subjects.parse_api_app(subject)
        return Carrier(
            AuditRecord(
                at=self.clock(),
                identity=caller.identity,
                name=caller.name,
                method="NATS",
                path=subject,
                status=200,
                app=app,
                request_id=request_id,
            )
        )

    async def record(
        self, subject: str, caller: Caller, status: int, request_id: str = "", *, upload: UploadOutcome | None = None
    ) -> None:
        app = subjects.parse_api_app(subject)
        record = AuditRecord(
            at=self.clock(),
            identity=caller.identity,
            name=caller.name,
            method="NATS",
            path=subject,
            status=status,
            app=app,
            request_id=request_id,
            upload=upload,
        )
        await self.trail.record(audit_subject(app), record)
