"""What every handler shares: the NATS connection's key, Fly's JSON replies, strict bodies, path checks."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from aiohttp import web
from nats.aio.client import Client

from bus import subjects
from bus.errors import BadRequest
from bus.messages import MACHINE_ID, Machine
from bus.service import call

MAX_BODY = 1024 * 1024
T = TypeVar("T")
NC: web.AppKey[Client] = web.AppKey("nc", Client)
_ENCODE = msgspec.json.Encoder()


class ClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_ENCODE.encode(value), content_type="application/json")


async def body(request: web.Request, kind: type[T]) -> T:
    raw = await request.read()
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ClientError(400, str(exc)) from None


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


async def ask(request: web.Request, verb: str, payload: Any, timeout: float = 30.0) -> Machine:
    subject = subjects.api_machines(app_name(request), verb)
    return await call(request.app[NC], subject, payload, Machine, timeout=timeout)


def nonce(request: web.Request) -> str | None:
    return request.headers.get("fly-machine-lease-nonce") or None
