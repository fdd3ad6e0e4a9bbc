"""`fauxmad apps list` and `apps destroy`: the apps the fleet knows, and an app removed with all its machines.

"The apps" are one set wherever they are listed (`names.app_names`, as `GET /v1/apps`): those with releases,
with machines (`machine run --app hello` makes one), or with a record made through the HTTP API.
"""

from __future__ import annotations

from typing import Any

import typer
from rich import box

from orchestrator.cli.app_options import with_reconciler
from orchestrator.cli.names import app_names, client_of, require_app
from orchestrator.cli.render import KEYS, FitTable, WideOption, console, print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, check_app, fail
from orchestrator.reconcile.destroy import destroy_app
from orchestrator.reconcile.reconciler import Reconciler

apps_app = typer.Typer(help="The apps: with releases, with machines, or made through the API.", no_args_is_help=True)


@apps_app.command("list")
def apps_list(nats: str | None = NatsOption, json_out: bool = JsonOption, wide: bool = WideOption) -> None:
    """Apps with their current release and desired counts."""

    async def go(r: Reconciler) -> list[dict[str, Any]]:
        out = []
        for name in sorted(set(await r.releases.apps()) | await app_names(client_of(r))):
            head = await r.releases.head(name)
            rel = await r.releases.current(name)
            # no current release: being destroyed, or its only deploys failed (null: nothing to describe)
            out.append(
                {
                    "app": name,
                    "release": rel.version if rel else None,
                    "status": rel.status if rel else "destroying" if head and head.destroyed else None,
                    "strategy": rel.spec.deploy.strategy if rel else None,
                    "regions": dict(rel.spec.regions) if rel else {},
                }
            )
        return out

    found = with_reconciler(nats, go)
    if json_out:
        print_json(found)
        return
    if not found:
        console.print("no apps (deploy one with `fauxmad deploy -c fauxmad.toml`, or `fauxmad machine run`)")
        return
    table = FitTable(header_style="bold", box=box.SIMPLE_HEAD, cut_first=("strategy", "status", "regions"))
    for col in ("app", "release", "status", "strategy", "regions"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for row in found:
        regions = ",".join(f"{k}={v}" for k, v in row["regions"].items())  # one word
        release = f"v{row['release']}" if row["release"] is not None else "-"
        status = row["status"] or ("no current release" if row["release"] is not None else "machines only")
        table.add_row(row["app"], release, status, row["strategy"] or "-", regions or "-")
    console.print(table)


@apps_app.command("destroy")
def apps_destroy(
    app: str = typer.Argument(..., help="the app to destroy, with all its machines and releases", callback=check_app),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
    nats: str | None = NatsOption,
) -> None:
    """Destroy every machine of an app in every region, then forget its releases."""
    if not yes:
        if not console.is_terminal:
            fail(f"destroying {app} removes all its machines: pass --yes to confirm", 2)
        typer.confirm(f"Destroy app {app} and all its machines?", abort=True)

    async def go(r: Reconciler) -> Any:
        await require_app(client_of(r), app)
        return await destroy_app(r, app)

    result = with_reconciler(nats, go)
    if not result.ok:
        fail(f"destroying {app}: {result.describe()}")
    console.print(f"app {app} destroyed")
