"""What every command needs: run a coroutine on uvloop, reach NATS, fail with one plain line.

Which fleet a command talks to: `--nats URL`, else the global `--fleet NAME` (a fleet named in the
config file), else `$FAUXMAD_NATS_URL`, else the config file's current fleet (`fauxmad fleet use`).
The config file is `$XDG_CONFIG_HOME/fauxmad/config.toml` (`~/.config/fauxmad/config.toml`).

Names a user types (apps, regions, machine and worker ids) become subject tokens and KV keys, where a
space, `.`, `*` or `>` would be an exception deep in nats-py or, worse, address something else. So
every option and argument that takes one is checked here, by its typer callback, with the bus's own
`check_token`: one rule, one message, exit 2 (bad input), before anything connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import tomllib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

import msgspec
import typer
import uvloop

from bus.contract.errors import BadRequest
from bus.contract.subjects import check_token
from bus.transport.connection import DEFAULT_URL_ENV

if TYPE_CHECKING:
    from orchestrator.client import FleetClient

T = TypeVar("T")

NATS_HELP = (
    f"NATS server URL (default: the global --fleet, else ${DEFAULT_URL_ENV}, else the current fleet of "
    "`fauxmad fleet use`)"
)

# Exit codes (docs/reference/exit-codes.md): applied at one edge, `orchestrator.cli.app.main`.
EXIT_OK = 0
EXIT_FAILED = 1  # the operation failed (no capacity, a timeout, a machine that did not stay up, ...)
EXIT_USAGE = 2  # usage or invalid input, a 400 from the fleet included
EXIT_UNREACHABLE = 3  # cannot reach the fleet: no NATS server there, or no broker/worker answering
EXIT_NOT_FOUND = 4  # a 404: no such machine, app, release or worker
EXIT_CONFLICT = 5  # a 409 or 412: the state (or a lease, or an idempotency key) forbids it
EXIT_FORBIDDEN = 6  # a 403: this identity's permissions (a secure fleet's nats-server) refuse it
EXIT_INTERNAL = 70  # a bug in fauxmad (EX_SOFTWARE); FAUXMAD_DEBUG=1 shows the traceback
EXIT_INTERRUPTED = 130  # Ctrl-C


class CliError(Exception):
    """A one-line message for the user, and the exit code to leave with; `details` go below it, indented."""

    def __init__(self, message: str, code: int = EXIT_FAILED, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.details = details or []


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    raise CliError(message, code)


def fail_lines(lines: list[str], code: int = EXIT_FAILED) -> NoReturn:
    """Fail with one line per distinct error, each `fauxmad: ...` (the last through the CLI's edge)."""
    for line in lines[:-1]:
        typer.echo(f"fauxmad: {line}", err=True)
    fail(lines[-1], code)


def warn(lines: list[str]) -> None:
    """One `fauxmad: warning: ...` line each on stderr: something the user should know, the command still done."""
    for line in lines:
        typer.echo(f"fauxmad: warning: {line}", err=True)


def key_values(pairs: list[str], option: str = "--env") -> dict[str, str]:
    """`KEY=VALUE` options (--env, --metadata) as a dict; a pair without `=` or a key exits 2 naming it."""
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"invalid {option} {pair!r}: use KEY=VALUE", EXIT_USAGE)
        values[key] = value
    return values


def checked(kind: str, value: str) -> str:
    """`value` if it is a valid name of `kind`, else fail with the bus's message and exit 2."""
    try:
        return check_token(kind, value)
    except BadRequest as exc:
        fail(exc.message, 2)


def split_names(kind: str, csv: str) -> list[str]:
    """A comma-separated list of names (empty items skipped), each checked."""
    return [checked(kind, name) for name in (part.strip() for part in csv.split(",")) if name]


_given: dict[str, str] = {}  # the names this command line gave ("app", "machine id", ...), for `names.explained`


def given() -> dict[str, str]:
    return dict(_given)


def _names(kind: str, *, csv: bool = False, fold: bool = False) -> Callable[[str | None], str | None]:
    """`fold`: the name ignores case (regions: `MAD` is `mad`)."""

    def callback(value: str | None) -> str | None:
        if value is not None:
            if fold:
                value = value.lower()
            if csv:
                split_names(kind, value)
            else:
                _given[kind] = checked(kind, value)
        return value

    return callback


# typer callbacks for every option and argument that takes a name: `typer.Option(..., callback=check_app)`
check_app = _names("app")
check_region = _names("region", fold=True)
check_regions = _names("region", csv=True, fold=True)  # a comma-separated list
check_machine_id = _names("machine id")
check_worker_id = _names("worker id")
check_fleet_name = _names("fleet name")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return uvloop.run(coro)


STOP_WITHIN = 2.0  # seconds from SIGINT or SIGTERM to the end of a long-running command, whatever it was doing
STOP_GRACE = 1.5  # of which its orderly stop may take this long; then the process ends anyway
# The HTTP API's and the edge proxy's grace: they keep nothing, so what their stop has not done by then is nothing
# lost, and the rest of STOP_WITHIN is margin for a loaded host (the signal waits for a busy event loop, the
# watchdog thread for a core). With 1.5 s they took 2.13 s and 2.01 s under load.
STATELESS_GRACE = 1.0
_at_forced_exit: list[Callable[[], None]] = []


def at_forced_exit(undo: Callable[[], None]) -> None:
    """Run `undo` (restore the terminal, say) if a stop outlasts `STOP_GRACE` and the process is ended anyway."""
    _at_forced_exit.append(undo)


def _end_now(message: str) -> None:
    """End the process at once, exit 0 (it was told to stop): a stop that hangs must not keep it alive."""
    for undo in reversed(_at_forced_exit):
        with contextlib.suppress(Exception):
            undo()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        sys.stderr.write(f"fauxmad: {message}\n")
        sys.stderr.flush()
    os._exit(EXIT_OK)


def serve(coro: Coroutine[Any, Any, T], *, what: str, grace: float = STOP_GRACE) -> T | None:
    """Run a long-running command (`what`: "worker", "status --watch", ...) until it returns or is told to stop.

    SIGINT and SIGTERM cancel it wherever it is (connecting, reconnecting, starting, serving, closing), so its
    own `finally` blocks close what it opened, and the call returns None (exit 0). Whatever that orderly stop
    waits for, the process ends within `STOP_WITHIN` seconds of the signal: after `grace` (`STOP_GRACE`, or
    `STATELESS_GRACE`) a watchdog thread ends it (a second signal at once). The command installs no signal
    handlers of its own.
    """
    stopped: list[int] = []

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            name = signal.Signals(signum).name
            if stopped:
                _end_now(f"{what}: {name} again: stopped at once")
            stopped.append(signum)
            watchdog = threading.Timer(
                grace, _end_now, (f"{what}: did not finish stopping within {grace:g}s: ended anyway",)
            )
            watchdog.daemon = True
            watchdog.start()
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        return await coro

    try:
        return run(main())
    except (asyncio.CancelledError, KeyboardInterrupt):
        if not stopped:
            raise
        return None


class Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


def with_connected(url: str | None, open_: Callable[[str], Awaitable[C]], fn: Callable[[C], Awaitable[T]]) -> T:
    """Open something connected to the fleet at `url` (or $FAUXMAD_NATS_URL), run `fn` with it, close it."""
    return run(_connected(url, open_, fn))


def serve_connected(
    url: str | None, open_: Callable[[str], Awaitable[C]], fn: Callable[[C], Awaitable[T]], *, what: str
) -> T | None:
    """`with_connected` for a long-running command (`what`): until `fn` returns, or SIGINT/SIGTERM (`serve`)."""
    return serve(_connected(url, open_, fn), what=what)


def _connected(
    url: str | None, open_: Callable[[str], Awaitable[C]], fn: Callable[[C], Awaitable[T]]
) -> Coroutine[Any, Any, T]:
    resolved = nats_url(url)
    assert resolved is not None

    async def main() -> T:
        opened = await open_(resolved)
        try:
            return await fn(opened)
        finally:
            await opened.close()

    return main()


def with_client(url: str | None, fn: Callable[[FleetClient], Awaitable[T]], *, name: str = "fauxmad-cli") -> T:
    """Run `fn` with a `FleetClient` connected to the fleet at `url` (`name`: the connection's, in NATS)."""
    from orchestrator.client import FleetClient

    return with_connected(url, lambda resolved: FleetClient.connect(resolved, name), fn)


def serve_client(
    url: str | None, fn: Callable[[FleetClient], Awaitable[T]], *, name: str = "fauxmad-cli", what: str
) -> T | None:
    """`with_client` for a long-running command (`what`): until `fn` returns, or SIGINT/SIGTERM (`serve`)."""
    from orchestrator.client import FleetClient

    return serve_connected(url, lambda resolved: FleetClient.connect(resolved, name), fn, what=what)


# ---------------------------------------------------------------------------------------------------
# the config file: named fleets


class FleetsConfig(msgspec.Struct, kw_only=True):
    """`config.toml`: `current = "NAME"` and a `[fleets.NAME]` table with `url` per fleet."""

    current: str | None = None
    fleets: dict[str, str] = {}  # name -> NATS URL


URL_SCHEMES = ("nats", "tls", "ws", "wss")
_selected_fleet: str | None = None  # the global --fleet option, set by the root callback


def select_fleet(name: str | None) -> None:
    global _selected_fleet
    _selected_fleet = check_fleet_name(name)


def config_path(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(base) / "fauxmad" / "config.toml"


def url_problem(url: str) -> str | None:
    """What is wrong with the NATS URL `url` (one server, or several comma-separated), or None if nothing."""
    from urllib.parse import urlsplit

    parts = [part.strip() for part in url.split(",")]
    if not url.strip() or not all(parts):
        return "it names no server"
    for part in parts:
        if any(c.isspace() for c in part):
            return f"{part!r} has a space in it"
        scheme, sep, _ = part.partition("://")
        if not sep:
            return f"{part!r} has no scheme"
        if scheme not in URL_SCHEMES:
            return f"{part!r}: unknown scheme {scheme!r}"
        try:
            split = urlsplit(part)
            split.port  # noqa: B018  # raises ValueError for a port that is not a number 0-65535
        except ValueError as exc:
            return f"{part!r}: {str(exc).lower()}"
        if not split.hostname:
            return f"{part!r} has no host"
    return None


def check_url(url: str) -> str:
    """`url` if it is a NATS URL, else one line naming it and what is wrong, exit 2."""
    problem = url_problem(url)
    if problem is not None:
        where = "" if problem.startswith(repr(url)) else f" {url!r}"
        fail(f"invalid NATS URL{where}: {problem} (use {'|'.join(URL_SCHEMES)}://HOST:PORT)", EXIT_USAGE)
    return url


def load_config(path: Path | None = None) -> FleetsConfig:
    """The config file (an empty one when there is none); a malformed file is one line naming it, exit 2."""
    path = path or config_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return FleetsConfig()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        fail(f"{path}: {exc}", EXIT_USAGE)
    current = data.get("current")
    if current is not None and not isinstance(current, str):
        fail(f"{path}: `current`: expected a fleet name (a string)", EXIT_USAGE)
    fleets: dict[str, str] = {}
    tables = data.get("fleets", {})
    if not isinstance(tables, dict):
        fail(f"{path}: `fleets`: expected a table of [fleets.NAME] tables", EXIT_USAGE)
    for name, table in tables.items():
        url = table.get("url") if isinstance(table, dict) else None
        if not isinstance(url, str):
            fail(f"{path}: `fleets.{name}.url`: expected a NATS URL (a string)", EXIT_USAGE)
        fleets[name] = url
    return FleetsConfig(current=current, fleets=fleets)


def save_config(config: FleetsConfig, path: Path | None = None) -> Path:
    """Write the config file whole (atomically); TOML basic strings escape like JSON's."""
    path = path or config_path()
    lines = ["# fauxmad's fleets: `fauxmad fleet add|use|remove|list` (rewritten by them)"]
    if config.current is not None:
        lines.append(f"current = {json.dumps(config.current)}")
    for name in sorted(config.fleets):
        key = name if name.replace("-", "").replace("_", "").isalnum() and name.isascii() else json.dumps(name)
        lines += ["", f"[fleets.{key}]", f"url = {json.dumps(config.fleets[name])}"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(path)
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror or exc}")
    return path


def fleet_url(name: str, config: FleetsConfig | None = None) -> str:
    config = config or load_config()
    url = config.fleets.get(name)
    if url is None:
        known = ", ".join(sorted(config.fleets)) or "none yet"
        fail(f"no fleet named {name!r} in {config_path()} (known: {known}; see `fauxmad fleet add`)", EXIT_USAGE)
    return url


def nats_url(value: str | None, *, required: bool = True) -> str | None:
    """The URL to reach: --nats, the global --fleet, $FAUXMAD_NATS_URL, then the config's current fleet;
    an invalid one is one line naming it and what is wrong, exit 2 (`check_url`).

    `required=False` (`fauxmad worker`, which starts an embedded server without one) skips the current
    fleet: a host must not join a fleet because someone once ran `fauxmad fleet use` on it.
    """
    if value:
        _given["nats"] = value
        return check_url(value)
    if _selected_fleet is not None:
        return check_url(fleet_url(_selected_fleet))
    url = os.environ.get(DEFAULT_URL_ENV)
    if url or not required:
        return check_url(url) if url else None
    config = load_config()
    if config.current is not None:
        return check_url(fleet_url(config.current, config))
    fail(
        f"no NATS server given: pass --nats URL, --fleet NAME or set {DEFAULT_URL_ENV}, "
        "or `fauxmad fleet add NAME URL --use` (see `fauxmad dev`)",
        EXIT_USAGE,
    )


def setup_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO if os.environ.get("FAUXMAD_LOG") else logging.WARNING
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")


# ---------------------------------------------------------------------------------------------------
# options and arguments many commands take, declared once (typer reads each as a parameter's default)


def nats_option(more_help: str = "") -> Any:
    """The `--nats URL` option (resolved by `nats_url`); `more_help` is appended to its help."""
    return typer.Option(None, "--nats", help=NATS_HELP + more_help, show_default=False)


NatsOption = nats_option()
JsonOption = typer.Option(False, "--json", help="print JSON instead of a table")
MachineAppOption = typer.Option(..., "--app", "-a", help="the app the machine belongs to", callback=check_app)
MachineIdArgument = typer.Argument(..., help="machine id", callback=check_machine_id)
WorkerIdArgument = typer.Argument(..., help="the worker", callback=check_worker_id)


MetricsOption = typer.Option(
    None, "--metrics-listen", help="HOST:PORT to serve Prometheus /metrics on (off by default)", show_default=False
)


def serve_metrics(listen: str | None) -> None:
    """Serve this process's Prometheus metrics at `listen` (prometheus_client's HTTP server, a thread)."""
    if listen is None:
        return
    from prometheus_client import start_http_server

    from orchestrator.proxy.run import parse_listen

    try:
        where = parse_listen(listen)
        start_http_server(where.port, where.host)
    except (ValueError, OSError) as exc:
        fail(f"--metrics-listen {listen}: {exc}", 2)


def shown_url(url: str) -> str:
    """`url` fit to print when a server starts: without a user or password it may carry."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))
