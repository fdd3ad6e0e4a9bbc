"""`fauxmad rollback`, `releases` and `scale count`: an app's releases, listed, gone back to, or made anew
with other machine counts (a new release with the same config, no restarts).
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import typer
from rich import box

from orchestrator.apps.releases import Release
from orchestrator.apps.spec import AppSpec
from orchestrator.cli.app_options import APP, with_reconciler
from orchestrator.cli.deploy_progress import DeployDisplay, cannot_deploy, print_outcome
from orchestrator.cli.names import client_of, require_app, require_regions
from orchestrator.cli.render import KEYS, FitTable, WideOption, console, print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, check_regions, fail, split_names
from orchestrator.reconcile import rollout
from orchestrator.reconcile.reconciler import Reconciler
from orchestrator.reconcile.rollout import SCALED, CannotDeploy, DeployOutcome

scale_app = typer.Typer(help="Change how many machines an app runs (a new release, no restarts).", no_args_is_help=True)


def rollback(
    version: int | None = typer.Argument(
        None, help="the release to go back to [default: the last good one before the current]"
    ),
    app: str = APP,
    force: bool = typer.Option(False, "--force", help="roll back to a release even if its deploy failed"),
    nats: str | None = NatsOption,
) -> None:
    """Point the app at an earlier release and converge every region onto it.

    A release whose deploy failed is refused unless --force; if the rollback fails, the app goes back to
    the release it ran before (the last good one).
    """

    async def go(r: Reconciler) -> DeployOutcome:
        await require_app(client_of(r), app)
        _, target = await rollout.rollback_target(r, app, version, force=force)  # refused before anything is shown
        with DeployDisplay(f"rolling {app} back to v{target.version}") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return await rollout.rollback(r, app, target.version, force=force)

    print_outcome(with_reconciler(nats, go))


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def releases(
    app: str = APP, nats: str | None = NatsOption, json_out: bool = JsonOption, wide: bool = WideOption
) -> None:
    """An app's releases, newest first, with status and the current one marked."""

    async def go(r: Reconciler) -> tuple[list[Release], int]:
        head = await r.releases.head(app)
        found = await r.releases.list(app)
        if not found:
            await require_app(client_of(r), app)
        return found, head.version if head else 0

    found, current = with_reconciler(nats, go)
    found.reverse()
    if json_out:
        print_json({"app": app, "current": current or None, "releases": found})
        return
    if not found:
        console.print(f"app {app} has no releases (deploy it with `fauxmad deploy -c fauxmad.toml`)")
        return
    # reasons go under the table, wrapped: one long reason must not squeeze every column to nothing
    # at 80 columns the description, then when and how, give way first (`FitTable`); a release's regions are
    # one word (`mad=3,syd=2`), never folded over two lines
    table = FitTable(
        header_style="bold", box=box.SIMPLE_HEAD, cut_first=("description", "created", "strategy", "status")
    )
    for col in ("version", "status", "strategy", "regions", "created", "description"):
        table.add_column(col, no_wrap=col in KEYS, overflow="fold")
    for rel in found:
        mark = " (current)" if rel.version == current else ""
        regions = ",".join(f"{k}={v}" for k, v in rel.spec.regions.items())
        status = rel.status + (" *" if rel.reason else "")
        table.add_row(
            f"v{rel.version}{mark}", status, rel.spec.deploy.strategy, regions, _when(rel.created_at), rel.description
        )
    console.print(table)
    for rel in found:
        if rel.reason:
            # prose to read, not to paste: wrapped at the width (a pipe has none)
            console.print(
                f"* v{rel.version} {rel.status}: {rel.reason}", highlight=False, markup=False, soft_wrap=False
            )


def _round_robin(count: int, regions: list[str], per_region_max: int | None) -> dict[str, int]:
    if per_region_max is not None and count > per_region_max * len(regions):
        fail(f"cannot run {count} machines in {len(regions)} region(s) with at most {per_region_max} per region")
    out = dict.fromkeys(regions, 0)
    i = 0
    for _ in range(count):
        while per_region_max is not None and out[regions[i % len(regions)]] >= per_region_max:
            i += 1
        out[regions[i % len(regions)]] += 1
        i += 1
    return out


@scale_app.command("count")
def scale_count(
    count: int = typer.Argument(..., min=0, max=10000, help="machines in total"),
    app: str = APP,
    region: str | None = typer.Option(
        None, "--region", "-r", help="comma-separated regions [default: the app's]", callback=check_regions
    ),
    max_per_region: int | None = typer.Option(None, "--max-per-region", min=1, help="at most this many per region"),
    nats: str | None = NatsOption,
) -> None:
    """Run COUNT machines, spread round robin over the regions: a new release with the same config."""

    async def go(r: Reconciler) -> DeployOutcome:
        if region:
            await require_regions(client_of(r), split_names("region", region))
        current = await r.releases.current(app)
        if current is None:
            await require_app(client_of(r), app)
            fail(f"app {app} has no current release: deploy it first (`fauxmad deploy -c fauxmad.toml`)")
        names = split_names("region", region) if region else list(current.spec.regions)
        if not names:
            fail("--region needs at least one region")
        counts = _round_robin(count, names, max_per_region)
        spec = msgspec.structs.replace(current.spec, regions=counts)
        try:
            spec = msgspec.convert(msgspec.to_builtins(spec), AppSpec)  # validates the region names
        except msgspec.ValidationError as exc:
            fail(f"invalid --region: {exc}")
        summary = ", ".join(f"{k}={v}" for k, v in counts.items())
        with DeployDisplay(f"scaling {app} to {summary}") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return await rollout.deploy(r, spec, f"{SCALED}count {count} ({summary})", always=True)

    try:
        outcome = with_reconciler(nats, go)
    except CannotDeploy as exc:
        cannot_deploy(exc.app, exc.problems)
    print_outcome(outcome)
