"""What every command needs: run a coroutine on uvloop, reach NATS, fail with one plain line.

Names a user types (apps, regions, machine and worker ids) become subject tokens and KV keys, where a
space, `.`, `*` or `>` would be an exception deep in nats-py or, worse, address something else. So
every option and argument that takes one is checked here, by its typer callback, with the bus's own
`check_token`: one rule, one message, exit 2 (bad input), before anything connects.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NoReturn, Protocol, TypeVar

import typer
import uvloop

from bus.connection import DEFAULT_URL_ENV
from bus.errors import BadRequest
from bus.subjects import check_token

T = TypeVar("T")

NATS_HELP = f"NATS server URL (default: ${DEFAULT_URL_ENV}; commands that need a fleet start one when unset)"


class CliError(Exception):
    """A one-line message for the user, and the exit code to leave with."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 1) -> NoReturn:
    raise CliError(message, code)


def checked(kind: str, value: str) -> str:
    """`value` if it is a valid name of `kind`, else fail with the bus's message and exit 2."""
    try:
        return check_token(kind, value)
    except BadRequest as exc:
        fail(exc.message, 2)


def split_names(kind: str, csv: str) -> list[str]:
    """A comma-separated list of names (empty items skipped), each checked."""
    return [checked(kind, name) for name in (part.strip() for part in csv.split(",")) if name]


def _names(kind: str, *, csv: bool = False) -> Callable[[str | None], str | None]:
    def callback(value: str | None) -> str | None:
        if value is not None:
            if csv:
                split_names(kind, value)
            else:
                checked(kind, value)
        return value

    return callback


# typer callbacks for every option and argument that takes a name: `typer.Option(..., callback=check_app)`
check_app = _names("app")
check_region = _names("region")
check_regions = _names("region", csv=True)  # a comma-separated list
check_machine_id = _names("machine id")
check_worker_id = _names("worker id")


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
