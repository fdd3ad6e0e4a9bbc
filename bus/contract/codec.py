"""JSON on the wire, with one msgspec decoder per message type, built once and reused.

Decoding failures become `BadRequest` carrying msgspec's own message, which names the offending
field (`Expected int >= 1 - at $.config.guest.cpus`): callers see exactly what to fix. A pattern's
message is said in words instead of its regex (`rules.in_words`: "machine id must be 14 hex digits"). This is the
one decoding edge, so it is also where hostile bytes become a 400 rather than a 500 further on:
- JSON must be UTF-8 (RFC 8259). msgspec raises a bare `UnicodeDecodeError` for invalid UTF-8 in a
  string it materializes and silently skips it in fields it ignores; a strict check of non-ASCII
  payloads (`isascii` first: tens of ns on a create of ~1.5 ms) refuses both, naming the byte.
- Escaped lone surrogates (`"\\ud800"`) are already a `DecodeError` in msgspec, so no decoded
  string can hold one and blow up later on `.encode()`.
- Nesting deep enough for a `RecursionError` (an `Any` field) is refused too.
Messages are clipped: msgspec echoes unknown field names and enum values, which a caller controls.
"""

from __future__ import annotations

from functools import cache
from typing import Any, TypeVar, cast

import msgspec

from bus.contract.errors import BadRequest
from bus.contract.rules import in_words

T = TypeVar("T")

CLIP = 200

_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


@cache
def decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


def clip(text: str, limit: int = CLIP) -> str:
    """`text`, or its first `limit` characters and how long it was: input echoed in a message stays short."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _short(message: str) -> str:
    """msgspec's message with any echoed input clipped, keeping the ` - at `$.path`` that names the field."""
    head, at, path = message.rpartition(" - at `")
    return clip(head) + at + path if at else clip(message)


def _checked(kind: Any, data: bytes, what: str) -> Any:
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError as exc:
            raise BadRequest(f"malformed JSON: invalid UTF-8 (byte {exc.start})") from None
    try:
        return decoder(kind).decode(data)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {in_words(_short(str(exc)))}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {_short(str(exc))}") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None


def decode(kind: type[T], data: bytes, *, empty_ok: bool = False) -> T:
    """Decode `data` as `kind`; an empty payload stands for `{}` when `empty_ok`."""
    if not data and empty_ok:
        data = b"{}"
    result: T = _checked(cast(Any, kind), data, "request")
    return result


def decode_any(kind: Any, data: bytes) -> Any:
    """Like `decode`, for union or generic types that `type[T]` cannot express."""
    return _checked(kind, data, "message")
