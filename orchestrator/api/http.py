"""What every handler shares: the way to the brokers, Fly's JSON replies, strict bodies, path checks.

The way to the brokers (`Brokers`): `fauxmad api` embeds a broker (`orchestrator.broker`, started without
serving NATS), so a create is placed in the API's own process, as Fly's flaps does it, and a machine's verbs
go from here to its worker: the HTTP leg replaces the client's leg to a broker instead of adding one
(`fauxmad bench api`: HTTP's cost over a NATS create went from +0.70 to -0.08 ms at p50). Without one
(`build` called without a broker) every request goes over NATS to the brokers, with the same answers and the
same errors."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from bus.contract import subjects
from bus.contract.base import MACHINE_ID
from bus.contract.codec import decode, encode
from bus.contract.deadlines import caller_wait
from bus.contract.errors import BadRequest, Unanswered
from bus.contract.machines import Machine
from bus.contract.rules import in_words
from bus.transport.nats_adapter import Nats
from bus.transport.service import call, request

MAX_BODY = 1024 * 1024
T = TypeVar("T")
NC: web.AppKey[Nats] = web.AppKey("nc", Nats)


class Answering(Protocol):
    """A broker in this process (`orchestrator.broker.service.Broker.answer`)."""

    async def answer(self, subject: str, data: bytes) -> bytes: ...


class Brokers:
    """Requests to the brokers: answered by the embedded one when there is one, else over NATS."""

    def __init__(self, nc: Nats, embedded: Answering | None = None) -> None:
        self.nc = nc
        self.embedded = embedded

    async def raw(self, subject: str, payload: Any, *, timeout: float) -> bytes:
        """The reply's bytes, or the `FauxmadError` it stands for."""
        if self.embedded is None:
            return bytes((await request(self.nc, subject, payload, timeout=timeout)).data)
        data = payload if isinstance(payload, bytes) else encode(payload)
        try:
            async with asyncio.timeout(timeout):  # no task per request, unlike wait_for: every request comes here
                return await self.embedded.answer(subject, data)
        except TimeoutError:
            raise Unanswered(f"no answer on {subject} within {timeout:g}s") from None

    async def call(self, subject: str, payload: Any, reply_type: type[T], *, timeout: float) -> T:
        if self.embedded is None:
            return await call(self.nc, subject, payload, reply_type, timeout=timeout)
        return decode(reply_type, await self.raw(subject, payload, timeout=timeout))


BROKERS: web.AppKey[Brokers] = web.AppKey("brokers", Brokers)
_ENCODE = msgspec.json.Encoder()


class ClientError(Exception):
    def __init__(self, status: int, message: str, *, machine_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.machine_id = machine_id  # a machine the request made and kept (a 422: it could not start)


def json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_ENCODE.encode(value), content_type="application/json")


async def body(request: web.Request, kind: type[T]) -> T:
    raw = await request.read()
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ClientError(400, in_words(str(exc))) from None


def machine_id(request: web.Request) -> str:
    value = request.match_info["machine_id"]
    if not MACHINE_ID.match(value):
        raise ClientError(404, f"machine {value!r} not found")
    return value


def app_name(request: web.Request) -> str:
    value = request.match_info["app_name"]
    try:
        return subjects.check_token("app", value)
    except BadRequest as exc:
        raise ClientError(400, str(exc)) from None


def flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true", "yes")


async def ask(request: web.Request, verb: str, payload: Any, *, own_timeout: float | None = None) -> Machine:
    """`verb` asked of the brokers, waited for as long as the contract's table says (`bus.contract.deadlines`)."""
    subject = subjects.api_machines(app_name(request), verb)
    return await request.app[BROKERS].call(subject, payload, Machine, timeout=caller_wait(verb, own_timeout))


def nonce(request: web.Request) -> str | None:
    return request.headers.get("fly-machine-lease-nonce") or None
