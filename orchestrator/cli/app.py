"""The typer application and `main`, the edge where every error becomes one line and an exit code."""

from __future__ import annotations

import os
import sys

import typer

try:  # typer >= 0.29 vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer depends on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[no-redef,import-not-found,unused-ignore,assignment]

from bus.errors import BadRequest, FauxmadError
from orchestrator.cli.runtime import CliError

app = typer.Typer(
    name="fauxmad",
    help="An orchestrator without Kubernetes and without consensus: workers own their machines, "
    "placement is a quick auction over NATS.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="log what happens (to stderr)"),
) -> None:
    """fauxmad: run `fauxmad demo` to see a fleet place and run machines in three regions."""
    from orchestrator.cli.runtime import setup_logging

    setup_logging(verbose)


def _register() -> None:
    from orchestrator.cli import bench_cmd, broker_cmd, deploy_cmd, fleet_cmd, machine_cmd, worker_cmd

    app.command("demo")(fleet_cmd.demo)
    app.command("dev")(fleet_cmd.dev)
    app.add_typer(machine_cmd.machine_app, name="machine")
    app.command("workers")(fleet_cmd.workers)
    app.command("regions")(fleet_cmd.regions)
    app.add_typer(worker_cmd.worker_app, name="worker")
    app.command("deploy")(deploy_cmd.deploy)
    app.command("rollback")(deploy_cmd.rollback)
    app.command("releases")(deploy_cmd.releases)
    app.command("reconcile")(deploy_cmd.reconcile)
    app.add_typer(deploy_cmd.scale_app, name="scale")
    app.add_typer(deploy_cmd.apps_app, name="apps")
    app.command("broker")(broker_cmd.broker)
    app.add_typer(bench_cmd.bench_app, name="bench")
    from orchestrator.cli import status_cmd

    app.command("status")(status_cmd.status)
    app.command("events")(status_cmd.events)


_register()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns (and exits with) the exit code. Never shows a traceback for user errors."""
    args = sys.argv[1:] if argv is None else argv
    try:
        result = app(args=args, prog_name="fauxmad", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except NoArgsIsHelpError as exc:
        typer.echo(exc.ctx.get_help() if exc.ctx else "")
        code = 0
    except UsageError as exc:
        path = exc.ctx.command_path if exc.ctx else "fauxmad"
        typer.echo(f"fauxmad: {exc.format_message()} (see '{path} --help')", err=True)
        code = 2
    except ClickException as exc:
        typer.echo(f"fauxmad: {exc.format_message()}", err=True)
        code = exc.exit_code
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        typer.echo("fauxmad: aborted", err=True)
        code = 130
    except CliError as exc:
        typer.echo(f"fauxmad: {exc}", err=True)
        code = exc.code
    except FauxmadError as exc:
        typer.echo(f"fauxmad: {exc.message}", err=True)
        code = 2 if isinstance(exc, BadRequest) else 1  # 400: bad input, like a usage error
    except KeyboardInterrupt:
        code = 130
    except Exception as exc:  # the edge: a bug is still one line, with the way to see more
        if os.environ.get("FAUXMAD_DEBUG"):
            raise
        typer.echo(f"fauxmad: unexpected error: {exc!r} (set FAUXMAD_DEBUG=1 for the traceback)", err=True)
        code = 70
    if argv is None:
        sys.exit(code)
    return code
