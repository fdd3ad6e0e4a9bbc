"""`[http_service]` of `fauxmad.toml`: how the edge proxy serves an app (after Fly's section of that name).

It lives with the spec (it is desired state, stored in the release) but is read only by `fauxmad proxy`,
which finds it in KV `fauxmad_apps`; the reconcilers ignore it. Defaults follow Fly's: 20 soft / 25 hard
requests per machine, autostart on.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from bus.contract.base import seconds


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class Concurrency(_Strict, frozen=True):
    # requests: each in-flight request takes a slot; connections: a client connection holds its machine (and
    # one slot) for as long as it lasts
    type: Literal["requests", "connections"] = "requests"
    soft_limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 20
    hard_limit: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 25

    def __post_init__(self) -> None:
        if self.soft_limit > self.hard_limit:
            raise ValueError("soft_limit must be at most hard_limit")


class HttpService(_Strict, frozen=True):
    internal_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None  # None: the machine's PORT
    concurrency: Concurrency = msgspec.field(default_factory=Concurrency)
    auto_start: bool = True
    auto_stop: Literal["off", "stop", "suspend"] = "off"
    min_machines_running: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0
    idle_timeout: float | str = "5m"
    auto_create: bool = False
    max_per_region: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 1  # machines auto_create may make per region

    def __post_init__(self) -> None:
        try:
            if seconds(self.idle_timeout) <= 0:
                raise ValueError("must be positive")
        except ValueError as exc:
            raise ValueError(f"idle_timeout: {exc}") from None

    @property
    def idle_seconds(self) -> float:
        return seconds(self.idle_timeout)
