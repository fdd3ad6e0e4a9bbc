"""JSON on the wire, with one msgspec decoder per message type, built once and reused.

Decoding failures become `BadRequest` carrying msgspec's own message, which names the offending
field (`Expected int >= 1 - at $.config.guest.cpus`): callers see exactly what to fix.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar, cast

import msgspec

from bus.errors import BadRequest

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


@cache
def decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


def decode(kind: type[T], data: bytes, *, empty_ok: bool = False) -> T:
    """Decode `data` as `kind`; an empty payload stands for `{}` when `empty_ok`."""
    if not data and empty_ok:
        data = b"{}"
    try:
        result: T = decoder(cast(Any, kind)).decode(data)
        return result
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


def decode_any(kind: Any, data: bytes) -> Any:
    """Like `decode`, for union or generic types that `type[T]` cannot express."""
    try:
        return decoder(kind).decode(data)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid message: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
