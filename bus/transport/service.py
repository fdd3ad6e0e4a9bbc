"""The one edge where a service's exceptions become the contract's error replies, and back.

Server side, `reply_error` writes the `Nats-Service-Error-Code` / `Nats-Service-Error` headers and the
`{"error": {"code", "message"}}` body; `Responder` runs a handler for each request in its own task (so
a slow verb never holds up the subscription) and guarantees every request is answered exactly once,
with a 500 for anything unexpected. Client side, `call` sends a request and turns an error reply or a
transport failure into the matching `FauxmadError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.micro.service import EndpointConfig

from bus.contract.base import ErrorBody, ErrorDetail
from bus.contract.codec import clip, decode, decoder, encode
from bus.contract.errors import FauxmadError, InternalError, Unanswered, Unreachable, error_for_code
from bus.contract.schema import endpoint_metadata
from bus.transport.audit import CALLER, CARRIER, REFUSED, UNSIGNED, Carrier, RequestAudit, mutating
from bus.transport.in_flight import BROKE, lost
from bus.transport.nats_adapter import signer_of

log = logging.getLogger(__name__)

T = TypeVar("T")

ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"

# An error message travels twice (header and body) and may echo what the caller sent: bounded, every
# reply stays far below any server's max_payload, so a hostile request can never get a process's
# connection closed by the server (which nats-py does not recover from).
MAX_ERROR_MESSAGE = 512
_ECHOED = re.compile(r"'([^']{65,})'")


def bounded_message(message: str, limit: int = MAX_ERROR_MESSAGE) -> str:
    """One line, echoed values cut to 64 characters, at most `limit` characters, valid UTF-8."""
    text = message.replace("\r", " ").replace("\n", " ")
    text = _ECHOED.sub(lambda m: f"'{clip(m.group(1), 64)}'", text)
    text = clip(text, limit)
    # a lone surrogate (from a decoded escape) cannot be encoded: make it visible instead
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_payload(code: int, message: str) -> tuple[bytes, dict[str, str]]:
    text = bounded_message(message)
    body = encode(ErrorBody(error=ErrorDetail(code=code, message=text)))
    # header values must stay on one line, in ASCII
    headers = {ERROR_CODE_HEADER: str(code), ERROR_HEADER: text.encode("ascii", "backslashreplace").decode("ascii")}
    return body, headers


ReplyFn = Callable[[bytes, dict[str, str] | None], Awaitable[None]]
Handler = Callable[[str, bytes], Awaitable[Any]]
NowHandler = Callable[[str, bytes], bytes]


class Responder:
    """Answers requests on behalf of handlers: every request answered once, errors per the contract.

    A handler takes `(subject, data)` and returns a msgspec Struct, a list of them, or raw bytes;
    it raises `FauxmadError` for a contract error. NATS objects stop here: handlers never see a
    `Msg`. Slow handlers run in a task of their own (`for_subscription`, `for_micro`); handlers that
    never wait can answer inline (`inline=True`), which saves a task switch on hot paths.
    """

    def __init__(self, nc: Client, name: str, *, audit: RequestAudit | None = None) -> None:
        """`audit`: identify the signer of every mutating request first (a bad signature is a 403) and record
        the request with its outcome in the audit trail before its reply goes out (`bus.transport.audit`)."""
        self._nc = nc
        self._name = name
        self._audit = audit
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.errors = 0

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def for_subscription(self, handler: Handler, *, inline: bool = False) -> Callable[[Msg], Awaitable[None]]:
        nc = self._nc

        async def on_message(msg: Msg) -> None:
            reply_to = msg.reply

            async def reply(data: bytes, headers: dict[str, str] | None) -> None:
                if reply_to:
                    await nc.publish(reply_to, data, headers=headers)

            answer = self._answer(handler, msg.subject, msg.data, reply, msg.headers)
            if inline:
                await answer
            else:
                self._spawn(answer)

        return on_message

    def for_subscription_now(self, handler: NowHandler) -> Callable[[Msg], Awaitable[None]]:
        """A handler that never waits (`(subject, data) -> reply bytes`), answered in the subscription's callback:
        no task, no coroutine per request. For the hottest subjects (a worker's offers: every worker answers
        every create's scatter). Not for mutating API subjects: nothing here audits."""
        nc = self._nc
        name = self._name

        async def on_message(msg: Msg) -> None:
            self.requests += 1
            headers: dict[str, str] | None = None
            try:
                body = handler(msg.subject, msg.data)
            except FauxmadError as err:
                self.errors += 1
                body, headers = error_payload(err.code, err.message)
            except Exception as exc:  # the edge: anything unexpected is a 500, never a crash
                log.exception("%s: unexpected error on %s", name, msg.subject)
                self.errors += 1
                body, headers = error_payload(InternalError.code, f"internal error: {exc!r}")
            if msg.reply:
                try:
                    await nc.publish(msg.reply, body, headers=headers)
                except Exception:
                    log.exception("%s: could not send reply", name)

        return on_message

    async def add_endpoint(self, service: Any, name: str, subject: str, handler: Handler, described: list[str]) -> None:
        """Serve `handler` on `subject` as endpoint `name` of a `nats.micro` service, its metadata naming the
        contract's channels `described` (the broker's and the worker's endpoints alike)."""
        await service.add_endpoint(
            EndpointConfig(
                name=name, subject=subject, handler=self.for_micro(handler), metadata=endpoint_metadata(*described)
            )
        )

    def for_micro(self, handler: Handler) -> Callable[[Any], Awaitable[None]]:
        """Adapt a handler to a `nats.micro` endpoint (whose requests carry the same fields)."""

        async def on_request(request: Any) -> None:
            async def reply(data: bytes, headers: dict[str, str] | None) -> None:
                with contextlib.suppress(ValueError):  # no reply subject: a plain publish
                    await request.respond(data, headers=headers)

            self._spawn(self._answer(handler, request.subject, request.data, reply, request.headers))

        return on_request

    async def _answer(
        self, handler: Handler, subject: str, data: bytes, reply: ReplyFn, headers: dict[str, str] | None = None
    ) -> None:
        self.requests += 1
        audit = self._audit if self._audit is not None and mutating(subject) else None
        caller = REFUSED  # until the signature checks out
        CALLER.set(UNSIGNED)
        carrier: Carrier | None = None
        CARRIER.set(None)
        try:
            if audit is not None:
                caller = audit.identify(subject, data, headers)
                CALLER.set(caller)  # the handler's (`current_caller`): this task's own context
                carrier = audit.carrier(subject, caller)
                CARRIER.set(carrier)  # a create keeps it in its `created` event (`audit_to_carry`)
            body = await answer(handler, subject, data, self._name)
            if audit is not None:
                if carrier is None or not carrier.carried:
                    await audit.record(subject, caller, 200)
                audit = None  # recorded: a failure of the reply itself is not a second request
            await reply(body, None)
            return
        except FauxmadError as err:
            failure = err
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reply itself failed: say so, as for a handler's own failure
            log.exception("%s: unexpected error on %s", self._name, subject)
            failure = InternalError(f"internal error: {exc!r}")
        self.errors += 1
        if audit is not None:
            await audit.record(subject, caller, failure.code)
        body, error_headers = error_payload(failure.code, failure.message)
        try:
            await reply(body, error_headers)
        except Exception:
            log.exception("%s: could not send error reply", self._name)

    async def drain(self, timeout: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()


async def answer(handler: Handler, subject: str, data: bytes, name: str) -> bytes:
    """`handler`'s answer to a request, as the bytes of its reply: a `FauxmadError` it raises is raised as is,
    anything else unexpected becomes an `InternalError` (a 500, never a crash). A `Responder` sends the result
    over NATS; a broker embedded in the HTTP API (`Broker.answer`) hands it back in process."""
    try:
        result = await handler(subject, data)
        return result if isinstance(result, bytes) else encode(result)
    except (FauxmadError, asyncio.CancelledError):
        raise
    except Exception as exc:  # the edge: anything unexpected is a 500, never a crash
        log.exception("%s: unexpected error on %s", name, subject)
        raise InternalError(f"internal error: {exc!r}") from None


def raise_for_reply(msg: Msg) -> None:
    """Raise the `FauxmadError` an error reply stands for; return quietly for a success."""
    headers = msg.headers or {}
    code = headers.get(ERROR_CODE_HEADER)
    if code is None:
        return
    message = headers.get(ERROR_HEADER, "")
    try:
        detail = decoder(ErrorBody).decode(msg.data).error
        raise error_for_code(detail.code, detail.message)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    try:
        number = int(code)
    except ValueError:
        number = 500
    raise error_for_code(number, message or f"error {code}")


class NoResponders(Unreachable):
    """Nobody listens on the subject at all (the server said so at once): the request was not delivered, so a
    caller may send it elsewhere (a region's own subject falling back to the fleet's)."""


async def request(nc: Client, subject: str, payload: Any, timeout: float = 5.0) -> Msg:
    """Send a request; raise `FauxmadError` for an error reply, `Unreachable` if nobody answers."""
    data = payload if isinstance(payload, bytes) else encode(payload)
    signer = signer_of(nc)
    headers = signer.headers(subject, data) if signer is not None and mutating(subject) else None
    try:
        # on a secure connection, a publish the server refuses is `Forbidden` at once (`Connection.request`)
        msg = await nc.request(subject, data, timeout=timeout, headers=headers)
    except NoRespondersError:
        raise NoResponders(f"nobody answers on {subject}") from None
    except NatsTimeout as exc:
        if lost(exc):  # its server went away (`bus.transport.in_flight`): known at once, not at the timeout
            raise Unanswered(f"no answer on {subject}: {BROKE}") from None
        raise Unanswered(f"no answer on {subject} within {timeout:g}s") from None
    except (NatsError, OSError) as exc:  # the connection broke with the request on its way: it may have arrived
        raise Unanswered(f"no answer on {subject}: {type(exc).__name__} {exc}".strip()) from None
    raise_for_reply(msg)
    return msg


async def call(nc: Client, subject: str, payload: Any, reply_type: type[T], timeout: float = 5.0) -> T:
    msg = await request(nc, subject, payload, timeout=timeout)
    return decode(reply_type, msg.data)
