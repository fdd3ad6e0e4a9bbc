"""What the app commands (deploy, reconcile, rollback, releases, scale, apps, worker drain) share: the spec
file's and the app's options, the spec loaded and checked (a bad spec is one line naming the key, before
anything touches the fleet), and a reconciler connected for the length of a command.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import typer

from orchestrator.apps.spec import AppSpec, SpecError, load_spec
from orchestrator.cli.runtime import CliError, check_app, checked, fail, with_connected
from orchestrator.reconcile.reconciler import Reconciler

T = TypeVar("T")

CONFIG = typer.Option(Path("fauxmad.toml"), "--config", "-c", help="the app spec file")
APP = typer.Option(..., "--app", "-a", help="the app", callback=check_app)


def with_reconciler(url: str | None, fn: Callable[[Reconciler], Awaitable[T]]) -> T:
    return with_connected(url, Reconciler.connect, fn)


def load_app_spec(path: Path) -> AppSpec:
    try:
        spec = load_spec(path)
    except SpecError as exc:
        fail(str(exc), 2)
    for kind, name in [("app", spec.app), *(("region", region) for region in spec.regions)]:
        try:
            checked(kind, name)
        except CliError as exc:
            fail(f"{path}: {exc}", 2)
    return spec
