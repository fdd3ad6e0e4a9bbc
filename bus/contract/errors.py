"""Errors that travel: each carries the HTTP-like code of the error contract and its retry rule.

`retry_after` is the rule (kopf's `TemporaryError(delay=...)`): the seconds a caller should wait before
sending the same request again, or `None` when the same request will fail the same way. Callers
branch on the type and this rule, never on the message.

A handler raises one of these; the service edge (`bus.transport.service`) turns it into the contract's error
reply, and `raise_for_reply` turns such a reply back into the same class on the caller's side. So
no code anywhere recognises an error by matching its text.
"""

from __future__ import annotations

from typing import ClassVar


class FauxmadError(Exception):
    """Base of every error that can cross the bus."""

    code: ClassVar[int] = 500
    retry_after: ClassVar[float | None] = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}, {self.message!r})"


class BadRequest(FauxmadError):
    code = 400


class NotFound(FauxmadError):
    code = 404


class Conflict(FauxmadError):
    """The machine is in a state (or under a lease) that forbids the request."""

    code = 409


class Forbidden(FauxmadError):
    """This identity may not do that: nats-server refused the request (a secure fleet's permissions)."""

    code = 403


class StaleVersion(FauxmadError):
    code = 412


class NoCapacity(FauxmadError):
    """The order was not filled: nothing was reserved. Another region or a smaller guest may fit."""

    code = 503
    retry_after = 1.0


class Unavailable(FauxmadError):
    """A part of the one answering is not ready (a broker whose JetStream-backed store cannot be reached yet):
    nothing was done. The contract's 503, so a caller reads it back as `NoCapacity` and asks again; the message
    names the part."""

    code = 503
    retry_after = 1.0


class DeadlineExceeded(FauxmadError):
    code = 504
    retry_after = 0.5


class InternalError(FauxmadError):
    code = 500


class Unreachable(FauxmadError):
    """Nobody answered on the bus: no one listens on the subject, so the request was not delivered.

    Its own code (502, the gateway's "the one behind me did not answer"), so a dead worker never reaches
    a user as "no capacity"."""

    code = 502
    retry_after = 0.25


class Unanswered(Unreachable):
    """No answer within the timeout. Unlike a refusal, the request may have been carried out: a caller
    that must not do a thing twice (reserve a machine) has to find out before it tries elsewhere."""

    retry_after = 0.0  # at once, with the same idempotency key: the retry finds out what happened


_BY_CODE: dict[int, type[FauxmadError]] = {
    400: BadRequest,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    412: StaleVersion,
    502: Unreachable,
    503: NoCapacity,
    504: DeadlineExceeded,
    500: InternalError,
}


def error_for_code(code: int, message: str) -> FauxmadError:
    """The error class a reply's code stands for; unknown codes keep their number."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message)
    err = InternalError(message)
    err.code = code  # type: ignore[misc]
    return err
