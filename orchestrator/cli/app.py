"""The typer application and `main`, the edge where every error becomes one line and an exit code.

The exit codes (docs/reference/exit-codes.md) are decided here and nowhere else: 0 ok, 1 the operation
failed, 2 usage or invalid input, 3 the fleet cannot be reached, 4 not found, 5 conflict, 70 a bug,
130 interrupted. A command either returns its code or raises; `main` maps what it raised.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

try:  # typer >= 0.29 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer depends on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[no-redef,import-not-found,unused-ignore,assignment]

from bus.contract.errors import (
    BadRequest,
    Conflict,
    FauxmadError,
    Forbidden,
    NotFound,
    StaleVersion,
    Unanswered,
    Unreachable,
)
from bus.contract.rules import in_words
from orchestrator.cli.names import Unknown
from orchestrator.cli.runtime import (
    EXIT_CONFLICT,
    EXIT_FAILED,
    EXIT_FORBIDDEN,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
)
from orchestrator.cli.stdio import whole_writes

app = typer.Typer(
    name="fauxmad",
    help="An orchestrator without Kubernetes and without consensus: workers own their machines, "
    "placement is a quick auction over NATS.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("fauxmad")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"fauxmad {version()}")
        raise typer.Exit(0)


@app.callback()
def root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="log what happens (to stderr)"),
    fleet: str | None = typer.Option(
        None,
        "--fleet",
        help="use this fleet of the config file (`fauxmad fleet list`); accepted anywhere before `--`",
        show_default=False,
    ),
    _version: bool = typer.Option(
        False, "--version", help="print the version and exit", is_eager=True, callback=_show_version
    ),
) -> None:
    """fauxmad: run `fauxmad demo` to see a fleet place and run machines in three regions."""
    from orchestrator.cli.runtime import select_fleet, setup_logging

    setup_logging(verbose)
    select_fleet(fleet)


# Every command: (name, module in orchestrator.cli, attribute, a group?), in the order `--help` lists them.
# A call imports and builds only the command it runs (typer builds a click command for every parameter of
# every registered command on each call: all of them cost 0.2 s a call, about a third of a short command).
COMMANDS: tuple[tuple[str, str, str, bool], ...] = (
    ("demo", "fleet_cmd", "demo", False),
    ("dev", "fleet_cmd", "dev", False),
    ("machine", "machine_cmd", "machine_app", True),
    ("workers", "fleet_cmd", "workers", False),
    ("regions", "fleet_cmd", "regions", False),
    ("fleet", "fleet_cmd", "fleet_app", True),
    ("secrets", "secrets_cmd", "secrets_app", True),
    ("image", "image_cmd", "image_app", True),
    ("volume", "volume_cmd", "volume_app", True),
    ("schema", "schema_cmd", "schema_app", True),
    ("token", "token_cmd", "token_app", True),
    ("worker", "worker_cmd", "worker_app", True),
    ("launch", "launch_cmd", "launch", False),
    ("deploy", "deploy_cmd", "deploy", False),
    ("rollback", "release_cmd", "rollback", False),
    ("releases", "release_cmd", "releases", False),
    ("reconcile", "deploy_cmd", "reconcile", False),
    ("scale", "release_cmd", "scale_app", True),
    ("apps", "apps_cmd", "apps_app", True),
    ("broker", "broker_cmd", "broker", False),
    ("proxy", "proxy_cmd", "proxy", False),
    ("api", "api_cmd", "api", False),
    ("status", "status_cmd", "status", False),
    ("events", "status_cmd", "events", False),
    ("logs", "logs_cmd", "logs", False),
    ("job", "job_cmd", "job_app", True),  # background jobs (docs/how-to/jobs.md)
)
_registered: set[str] = set()


PLUGIN_GROUP = "fauxmad.commands"  # entry points adding commands: the lab's bench, sim and torture (lab/cli)


def register(names: set[str] | None = None) -> None:
    """Add the commands `names` (None: all) to `app`, each once, in `COMMANDS` order, then the plugins' (the entry
    points of `PLUGIN_GROUP`, in name order): a command the product does not know is never imported by it."""
    import importlib

    for name, module_name, attribute, group in COMMANDS:
        if name in _registered or (names is not None and name not in names):
            continue
        module = importlib.import_module(f"orchestrator.cli.{module_name}")
        target = getattr(module, attribute)
        if name == "fleet":
            from orchestrator.cli import layout_cmd, security_cmd

            security_cmd.register(target)
            layout_cmd.register(target)
        _add(name, target, group)
    if names is None or not names <= {entry[0] for entry in COMMANDS}:
        _register_plugins(names)


def _register_plugins(names: set[str] | None) -> None:
    from importlib.metadata import entry_points

    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda point: point.name):
        if entry.name in _registered or (names is not None and entry.name not in names):
            continue
        target = entry.load()
        _add(entry.name, target, isinstance(target, typer.Typer))


def _add(name: str, target: Any, group: bool) -> None:
    if group:
        app.add_typer(target, name=name)
    else:
        app.command(name)(target)
    _registered.add(name)


_built: tuple[tuple[Any, ...], Any] | None = None  # the click command made of `app`, and what `app` held then


def _click_command() -> Any:
    """The click command `app` runs as, made again only when `app`'s commands or groups changed since (what
    `app(...)` does on every call: a caller of `main` in-process, such as a test running a command for each of 40
    argument lists, spent a fifth of its time making the same command over again)."""
    global _built
    held = (*app.registered_commands, *app.registered_groups)
    if _built is None or _built[0] != held:  # typer's CommandInfo and TyperInfo compare by identity
        _built = (held, typer.main.get_command(app))
    return _built[1]


def command_named(args: list[str]) -> str | None:
    """The command `args` run (after the root's own options), or None (root help, completion, a typo)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--fleet":
            i += 2
            continue
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
        i += 1
    return None


def lift_global_options(args: list[str]) -> list[str]:
    """Move `--fleet NAME` / `--fleet=NAME` found after the subcommand to the front.

    `--fleet` belongs to the root command (it chooses the fleet for every subcommand), but people type
    it at the end (`fauxmad machine list -a web --fleet prod`), as flyctl's and kubectl's persistent
    flags allow. Nothing after `--` is touched: that is a machine's command.
    """
    end = args.index("--") if "--" in args else len(args)
    lifted: list[str] = []
    rest: list[str] = []
    i = 0
    while i < end:
        arg = args[i]
        if arg == "--fleet" and i + 1 < end:
            lifted += ["--fleet", args[i + 1]]
            i += 2
            continue
        if arg.startswith("--fleet="):
            lifted.append(arg)
        else:
            rest.append(arg)
        i += 1
    return lifted + rest + args[end:] if lifted else args


def exit_code_for(exc: FauxmadError) -> int:
    """The exit code of an error from the fleet (or from reaching it)."""
    if isinstance(exc, Unreachable) and not isinstance(exc, Unanswered):
        return EXIT_UNREACHABLE  # no server, or nobody serves the subject: nothing was delivered
    if isinstance(exc, BadRequest):
        return EXIT_USAGE  # 400: bad input, like a usage error
    if isinstance(exc, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(exc, Forbidden):
        return EXIT_FORBIDDEN
    if isinstance(exc, Conflict | StaleVersion):
        return EXIT_CONFLICT
    return EXIT_FAILED  # 503 no capacity, 504, an unanswered request (its outcome unknown), a remote 500


def _lost_connection(exc: Exception) -> bool:
    """nats-py's own errors for a connection that went away while a command used it."""
    import nats.errors

    lost = (nats.errors.ConnectionClosedError, nats.errors.NoServersError, nats.errors.StaleConnectionError)
    return isinstance(exc, lost)


def _nats_timeout(exc: Exception) -> bool:
    """A request to NATS or JetStream that got no answer within its timeout (nats-py's own error)."""
    import nats.errors

    return isinstance(exc, nats.errors.TimeoutError)


def _jetstream_unavailable(exc: Exception) -> bool:
    """JetStream's 503 (no meta leader for longer than a request waits, or no JetStream server in reach)."""
    from nats.js.errors import ServiceUnavailableError

    return isinstance(exc, ServiceUnavailableError)


def _click_exit(exc: Exception) -> int | None:
    """The exit code of typer's and click's own exceptions (after saying why), or None for others."""
    if isinstance(exc, NoArgsIsHelpError):  # its help was made once, when it was raised: printed already (rich
        text = exc.format_message()  # help prints as it formats) or kept here; never asked for again
        if text.strip():
            typer.echo(text)
        return 0
    if isinstance(exc, UsageError):
        path = exc.ctx.command_path if exc.ctx else "fauxmad"
        typer.echo(f"fauxmad: {exc.format_message()} (see '{path} --help')", err=True)
        return EXIT_USAGE
    if isinstance(exc, ClickException):
        typer.echo(f"fauxmad: {exc.format_message()}", err=True)
        return exc.exit_code
    if isinstance(exc, typer.Exit):
        return exc.exit_code
    if isinstance(exc, typer.Abort):
        typer.echo("fauxmad: aborted", err=True)
        return EXIT_INTERRUPTED
    return None


def _say(line: str) -> None:
    """One line of an error to stderr; on a terminal, control characters in it (a name, a machine's stderr
    echoed back) are shown as escapes (`render.visible`), never obeyed."""
    if sys.stderr.isatty():
        from orchestrator.cli.render import visible

        line = visible(line)
    typer.echo(line, err=True)


NATS_HINT = " (start a fleet with `fauxmad dev`, or point FAUXMAD_NATS_URL or --nats at a running one)"


def _reach_hint(exc: FauxmadError) -> str:
    """What resolves "cannot reach NATS": the command that starts a fleet, the variable and flag that name one."""
    unreachable = isinstance(exc, Unreachable) and not isinstance(exc, Unanswered)
    return NATS_HINT if unreachable and exc.message.startswith("cannot reach NATS at") else ""


def _not_found(message: str, code: int) -> str:
    """A not-found error said by the name the fleet does not know, with the closest ones (`names.explained`)."""
    if code != EXIT_NOT_FOUND:
        return message
    from orchestrator.cli.names import explained

    return explained(message)


def report(exc: Exception) -> int:
    """Say what went wrong in one line (and a CliError's details below it); return the exit code."""
    code = _click_exit(exc)
    if code is not None:
        return code
    if isinstance(exc, CliError):  # messages in words: a pattern's rule, never its regex (`rules.in_words`)
        said = str(exc) if isinstance(exc, Unknown) else _not_found(str(exc), exc.code)
        _say(f"fauxmad: {in_words(said)}")
        for line in exc.details:
            _say(f"  {in_words(line)}")
        return exc.code
    if isinstance(exc, FauxmadError):
        code = exit_code_for(exc)
        _say(f"fauxmad: {in_words(_not_found(exc.message, code))}{_reach_hint(exc)}")
        return code
    if os.environ.get("FAUXMAD_DEBUG"):
        raise exc
    if _lost_connection(exc):
        typer.echo(f"fauxmad: lost the connection to NATS: {exc!r}", err=True)
        return EXIT_UNREACHABLE
    if _nats_timeout(exc):
        typer.echo("fauxmad: NATS did not answer in time (a server down, or electing a leader?): try again", err=True)
        return EXIT_UNREACHABLE
    if _jetstream_unavailable(exc):
        typer.echo(
            "fauxmad: JetStream is unavailable (its cluster has had no leader for 10s, or no server of it is in"
            " reach): try again in a few seconds",
            err=True,
        )
        return EXIT_UNREACHABLE
    # the edge: a bug is still one line, with the way to see more
    typer.echo(f"fauxmad: unexpected error: {exc!r} (set FAUXMAD_DEBUG=1 for the traceback)", err=True)
    return EXIT_INTERNAL


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the exit code. Never shows a traceback for user errors."""
    whole_writes()
    args = lift_global_options(sys.argv[1:] if argv is None else argv)
    name = command_named(args)
    register({name} if name in {c[0] for c in COMMANDS} else None)  # a typo or --help: all, to list or suggest
    try:
        result = _click_command().main(args=args, prog_name="fauxmad", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except Exception as exc:
        code = report(exc)
    if argv is None:
        sys.exit(code)
    return code
