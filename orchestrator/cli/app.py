"""The typer application and `main`, the edge where every error becomes one line and an exit code.

The exit codes (README "Exit codes") are decided here and nowhere else: 0 ok, 1 the operation
failed, 2 usage or invalid input, 3 the fleet cannot be reached, 4 not found, 5 conflict, 70 a bug,
130 interrupted. A command either returns its code or raises; `main` maps what it raised.
"""

from __future__ import annotations

import os
import sys

import typer

try:  # typer >= 0.29 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer depends on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[no-redef,import-not-found,unused-ignore,assignment]

from bus.errors import BadRequest, Conflict, FauxmadError, Forbidden, NotFound, StaleVersion, Unanswered, Unreachable
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


def _register() -> None:
    from orchestrator.cli import (
        bench_cmd,
        broker_cmd,
        deploy_cmd,
        fleet_cmd,
        machine_cmd,
        secrets_cmd,
        security_cmd,
        worker_cmd,
    )

    app.command("demo")(fleet_cmd.demo)
    app.command("dev")(fleet_cmd.dev)
    app.add_typer(machine_cmd.machine_app, name="machine")
    app.command("workers")(fleet_cmd.workers)
    app.command("regions")(fleet_cmd.regions)
    security_cmd.register(fleet_cmd.fleet_app)
    app.add_typer(fleet_cmd.fleet_app, name="fleet")
    app.add_typer(secrets_cmd.secrets_app, name="secrets")
    from orchestrator.cli import image_cmd, token_cmd

    app.add_typer(image_cmd.image_app, name="image")
    from orchestrator.cli import volume_cmd

    app.add_typer(volume_cmd.volume_app, name="volume")
    from orchestrator.cli import schema_cmd

    app.add_typer(schema_cmd.schema_app, name="schema")

    app.add_typer(token_cmd.token_app, name="token")
    app.add_typer(worker_cmd.worker_app, name="worker")
    app.command("deploy")(deploy_cmd.deploy)
    app.command("rollback")(deploy_cmd.rollback)
    app.command("releases")(deploy_cmd.releases)
    app.command("reconcile")(deploy_cmd.reconcile)
    app.add_typer(deploy_cmd.scale_app, name="scale")
    app.add_typer(deploy_cmd.apps_app, name="apps")
    app.command("broker")(broker_cmd.broker)
    from orchestrator.cli import proxy_cmd

    app.command("proxy")(proxy_cmd.proxy)
    from orchestrator.cli import api_cmd

    app.command("api")(api_cmd.api)
    app.add_typer(bench_cmd.bench_app, name="bench")
    from orchestrator.cli import sim_cmd

    app.command("sim")(sim_cmd.sim)
    from orchestrator.cli import status_cmd

    app.command("status")(status_cmd.status)
    app.command("events")(status_cmd.events)
    from orchestrator.cli import logs_cmd

    app.command("logs")(logs_cmd.logs)
    from orchestrator.cli import job_cmd  # background jobs (README "Background jobs")

    app.add_typer(job_cmd.job_app, name="job")


_register()


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


def _click_exit(exc: Exception) -> int | None:
    """The exit code of typer's and click's own exceptions (after saying why), or None for others."""
    if isinstance(exc, NoArgsIsHelpError):
        typer.echo(exc.ctx.get_help() if exc.ctx else "")
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


def report(exc: Exception) -> int:
    """Say what went wrong in one line (and a CliError's details below it); return the exit code."""
    code = _click_exit(exc)
    if code is not None:
        return code
    if isinstance(exc, CliError):
        typer.echo(f"fauxmad: {exc}", err=True)
        for line in exc.details:
            typer.echo(f"  {line}", err=True)
        return exc.code
    if isinstance(exc, FauxmadError):
        typer.echo(f"fauxmad: {exc.message}", err=True)
        return exit_code_for(exc)
    if os.environ.get("FAUXMAD_DEBUG"):
        raise exc
    if _lost_connection(exc):
        typer.echo(f"fauxmad: lost the connection to NATS: {exc!r}", err=True)
        return EXIT_UNREACHABLE
    # the edge: a bug is still one line, with the way to see more
    typer.echo(f"fauxmad: unexpected error: {exc!r} (set FAUXMAD_DEBUG=1 for the traceback)", err=True)
    return EXIT_INTERNAL


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the exit code. Never shows a traceback for user errors."""
    args = lift_global_options(sys.argv[1:] if argv is None else argv)
    try:
        result = app(args=args, prog_name="fauxmad", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except Exception as exc:
        code = report(exc)
    if argv is None:
        sys.exit(code)
    return code
