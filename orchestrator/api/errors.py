"""Errors as Fly writes them: `{"error": "...", "status": "..."}` with the HTTP status of the bus error."""

from __future__ import annotations

import msgspec
from aiohttp import web

from bus.errors import FauxmadError
from orchestrator.api.types import ErrorResponse

_ENCODER = msgspec.json.Encoder()


def error_response(status: int, message: str) -> web.Response:
    if status == 503:
        body = _ENCODER.encode(ErrorResponse(error=message, status="insufficient_capacity"))
    else:
        body = _ENCODER.encode(ErrorResponse(error=message))
    return web.Response(status=status, body=body, content_type="application/json")


def from_bus(exc: FauxmadError) -> web.Response:
    return error_response(exc.code, exc.message)
