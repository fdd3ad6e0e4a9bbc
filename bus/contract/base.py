"""The ground every message stands on: strict requests and lenient replies, the shared field types
(tokens, machine ids, names, durations, machine states), and the error reply's body.

Requests are strict (`forbid_unknown_fields`): a misspelt field is a 400 naming it rather than a
silently ignored option. Replies are lenient, so a newer worker or broker can add fields without
breaking older callers. Field names follow the Fly Machines API where one exists. Every addition to
the contract in DESIGN.md is listed in docs/reference/nats-contract.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

MACHINE_ID = re.compile(r"^[0-9a-f]{14}$")


NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"


TOKEN_CHARS = r"[A-Za-z0-9_-]{1,64}"  # one subject token a user may name: an app, a region, a key
TOKEN_PATTERN = rf"^{TOKEN_CHARS}$"
Token = Annotated[str, msgspec.Meta(pattern=TOKEN_PATTERN)]


MachineId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{14}$")]


Name = Annotated[str, msgspec.Meta(pattern=NAME)]


SECONDS_MAX = 86400.0  # the longest wait a request may ask for (a day)
Seconds = Annotated[float, msgspec.Meta(ge=0, le=SECONDS_MAX)]


# A guest's bounds, written once: machines, offers, jobs, the HTTP API and the app spec all size a guest with them.
Cpus = Annotated[int, msgspec.Meta(ge=1, le=1024)]


MemoryMb = Annotated[int, msgspec.Meta(gt=0, le=16 * 1024 * 1024)]


VOLUME_ID_PATTERN = r"^vol_[0-9a-z]{16}$"
VolumeId = Annotated[str, msgspec.Meta(pattern=VOLUME_ID_PATTERN)]


SnapshotId = Annotated[str, msgspec.Meta(pattern=r"^vs_[0-9a-z]{16}$")]


State = Literal[
    "created",
    "starting",
    "started",
    "stopping",
    "stopped",
    "destroying",
    "destroyed",
    "failed",
    "replacing",
    "suspending",  # addition: the process is being frozen (SIGSTOP of its process group)
    "suspended",  # addition: frozen; memory kept, no CPU; `resume` continues it where it was
]


class Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of everything a caller sends: unknown fields are an error."""


class Reply(msgspec.Struct, kw_only=True):
    """Base of everything a service answers: unknown fields are ignored (forward compatible).

    Every field is written, defaults included, so callers in any language see the whole record;
    fields that exist only on some answers (`events` on get) are `UNSET` and then left out.
    """


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")


_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def seconds(value: float | str) -> float:
    """A duration as seconds: a number, or a string such as `500ms`, `10s`, `2m` (Fly's style)."""
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"negative duration {value}")
        return float(value)
    match = _DURATION.match(value.strip())
    if not match:
        raise ValueError(f"invalid duration {value!r}: use seconds or a string like '10s' or '500ms'")
    return float(match.group(1)) * _UNIT[match.group(2)]


class ErrorDetail(Reply):
    code: int
    message: str


class ErrorBody(Reply):
    error: ErrorDetail


class Ack(Reply):
    ok: bool = True
    message: str = ""
