"""What every command needs: run a coroutine on uvloop, reach NATS, fail with one plain line."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn, Protocol, TypeVar

import typer
import uvloop

from bus.connection import DEFAULT_URL_ENV

T = TypeVar("T")

NATS_HELP = f"NATS server URL (default: ${DEFAULT_URL_ENV}; commands that need a fleet start one when unset)"


class CliError(Exception):
    """A one-line message for the user, and the exit code to leave with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 1) -> NoReturn:
    raise CliError(message, code)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return uvloop.run(coro)


class Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


def with_connected(url: str | None, open_: Callable[[str], Awaitable[C]], fn: Callable[[C], Awaitable[T]]) -> T:
    """Open something connected to the fleet at `url` (or $FAUXMAD_NATS_URL), run `fn` with it, close it."""
    resolved = nats_url(url)
    assert resolved is not None

    async def main() -> T:
        opened = await open_(resolved)
        try:
            return await fn(opened)
        finally:
            await opened.close()

    return run(main())


def with_client(url: str | None, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Run `fn` with a `FleetClient` connected to the fleet at `url`."""
    from orchestrator.client import FleetClient

    return with_connected(url, FleetClient.connect, fn)


def nats_url(value: str | None, *, required: bool = True) -> str | None:
    url = value or os.environ.get(DEFAULT_URL_ENV)
    if required and not url:
        fail(f"no NATS server given: pass --nats URL or set {DEFAULT_URL_ENV} (see `fauxmad dev`)")
    return url


def setup_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO if os.environ.get("FAUXMAD_LOG") else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


NatsOption = typer.Option(None, "--nats", help=NATS_HELP, show_default=False)
JsonOption = typer.Option(False, "--json", help="print JSON instead of a table")
