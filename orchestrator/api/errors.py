"""Errors as Fly writes them: `{"error": "...", "status": "..."}` with the HTTP status of the bus error (and,
as an extension, the `machine_id` of a machine that was made but could not start)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from bus.contract.errors import FauxmadError
from orchestrator.api.types import ErrorResponse

_ENCODER = msgspec.json.Encoder()


def error_response(status: int, message: str, *, machine_id: str | None = None) -> web.Response:
    kept = machine_id if machine_id is not None else msgspec.UNSET
    if status == 503:
        body = _ENCODER.encode(ErrorResponse(error=message, status="insufficient_capacity", machine_id=kept))
    else:
        body = _ENCODER.encode(ErrorResponse(error=message, machine_id=kept))
    return web.Response(status=status, body=body, content_type="application/json")


def from_bus(exc: FauxmadError) -> web.Response:
    return error_response(exc.code, exc.message)
