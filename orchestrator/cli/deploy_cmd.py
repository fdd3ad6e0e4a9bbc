"""`fauxmad deploy` and `fauxmad reconcile`: an app spec onto the fleet, once or as the operator.

Each is a thin edge over `orchestrator.reconcile.rollout` (and `watch`, the operator): parse and check the
input, connect, run the loop with a progress display, and turn the outcome into an exit code. `deploy
--dry-run` shows the preview as a table (or JSON) and changes nothing.
"""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import msgspec
import typer
from rich import box
from rich.table import Table

from bus.stores.images import ImageError
from orchestrator.apps.spec import AppSpec
from orchestrator.cli.app_options import CONFIG, load_app_spec, with_reconciler
from orchestrator.cli.deploy_progress import DeployDisplay, cannot_deploy, print_outcome
from orchestrator.cli.detached_deploy import Detached, finish_detached, start_detached
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import (
    NatsOption,
    check_app,
    check_region,
    checked,
    fail,
    fail_lines,
    serve_connected,
    warn,
    with_connected,
)
from orchestrator.images import pin_image
from orchestrator.reconcile import rollout
from orchestrator.reconcile.executor import Result
from orchestrator.reconcile.preview import Planned
from orchestrator.reconcile.reconciler import Reconciler
from orchestrator.reconcile.rollout import CannotDeploy, DeployOutcome, Preview
from orchestrator.reconcile.watch import Operator


def load_with_image(path: Path, image: str | None) -> AppSpec:
    """The spec at `path`, running `image` when one is given (`fly deploy --image`): the spec's own `image`,
    `build` and `workdir` give way (the image's files are where its command runs), and the spec need not say
    a `cmd` when the image has one. A bad spec or an empty reference is one line, exit 2."""
    if image is None:
        return load_app_spec(path)
    if not image.strip():
        fail("--image: give a name:tag or sha256:... of the fleet's store (`fauxmad image ls`)", 2)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        fail(f"{path}: no such file (pass -c PATH, or run where fauxmad.toml is)", 2)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        fail(f"{path}: cannot read: {exc}", 2)
    data = {k: v for k, v in data.items() if k not in ("build", "workdir")}
    try:
        spec = msgspec.convert({**data, "image": image}, AppSpec, strict=True)
    except (msgspec.ValidationError, ValueError) as exc:
        fail(f"{path}: {exc}", 2)
    for kind, name in [("app", spec.app), *(("region", region) for region in spec.regions)]:
        checked(kind, name)
    return spec


def _outcome_json(outcome: DeployOutcome, warnings: list[str]) -> dict[str, Any]:
    return {
        "app": outcome.release.app,
        "release": outcome.release.version,
        "status": outcome.release.status,
        "ok": outcome.ok,
        "changed": outcome.changed,
        "message": outcome.message,
        "errors": outcome.errors,
        "rolled_back_to": outcome.rolled_back_to,
        "warnings": warnings,
        "seconds": round(outcome.seconds, 3),
    }


def deploy(
    config: Path = CONFIG,
    dry_run: bool = typer.Option(False, "--dry-run", help="show every step the deploy would take; change nothing"),
    detach: bool = typer.Option(False, "--detach", help="start the deploy and return; it goes on in the background"),
    json_out: bool = typer.Option(False, "--json", help="print the outcome (or, with --dry-run, the plan) as JSON"),
    image: str | None = typer.Option(
        None,
        "--image",
        help="deploy this image (name:tag or sha256:... in the fleet's store) instead of the spec's image, build or "
        "workdir; the spec's cmd, if any, still runs in it",
    ),
    finish_release: int | None = typer.Option(None, "--finish-release", hidden=True),
    finish_app: str | None = typer.Option(None, "--finish-app", hidden=True, callback=check_app),
    nats: str | None = NatsOption,
) -> None:
    """Deploy the app in fauxmad.toml to every region it names, per its [deploy] strategy.

    First it checks that every region has live workers with room for the machines it must create;
    if not, it fails before touching anything. A spec the app already runs makes no release. Health
    checks gate progress, and a machine whose process ends on its own fails its region at once; if
    any region fails, every region goes back to the previous good release (or, with none, what the
    deploy created is removed) and the command exits non-zero saying what failed where.
    """
    if finish_release is not None and finish_app is not None:
        finish_detached(finish_app, finish_release, nats)
        return
    spec = load_with_image(config, image)

    async def go(r: Reconciler) -> tuple[Preview, DeployOutcome | Detached | None]:
        nonlocal spec
        if spec.image is not None or spec.build is not None:
            try:
                spec = await pin_image(r.jetstream(), spec, say=lambda line: None if json_out else print(line))
            except ImageError as exc:
                fail(str(exc), 2)
        seen = await rollout.preview(r, spec)
        if dry_run or seen.problems:
            return seen, None
        if detach and seen.changes:
            return seen, await start_detached(r, spec, nats)
        if json_out or not (seen.changes or seen.actions):  # nothing to show progress of
            return seen, await rollout.deploy(r, spec, checked=seen)
        warn(seen.warnings)
        with DeployDisplay(f"deploying {spec.app} ({spec.deploy.strategy}) to {', '.join(spec.regions)}") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return seen, await rollout.deploy(r, spec, checked=seen)

    try:
        seen, outcome = with_reconciler(nats, go)
    except CannotDeploy as exc:  # the fleet changed between the preview and the deploy
        cannot_deploy(exc.app, exc.problems)
    if dry_run:
        _show_preview(seen, json_out)
    if seen.problems:
        cannot_deploy(spec.app, seen.problems)
    if outcome is not None:
        _report(seen, outcome, json_out)


def _report(seen: Preview, outcome: DeployOutcome | Detached, json_out: bool) -> None:
    if isinstance(outcome, Detached):
        if json_out:
            print_json({"app": seen.app, "release": outcome.release, "detached": True, "log": outcome.log})
            return
        warn(seen.warnings)
        console.print(
            f"v{outcome.release} of {seen.app} is deploying in the background (log: {outcome.log}); "
            f"`fauxmad releases -a {seen.app}` shows when it is complete or failed",
            highlight=False,
            soft_wrap=True,
        )
        return
    if json_out:
        print_json(_outcome_json(outcome, seen.warnings))
        warn(seen.warnings)
        if not outcome.ok:
            fail_lines(outcome.lines())
        return
    print_outcome(outcome)


def _show_preview(seen: Preview, json_out: bool) -> None:
    if json_out:
        print_json(
            {
                "app": seen.app,
                "release": seen.release,
                "current": seen.current.version if seen.current else None,
                "changes": seen.changes,
                "feasible": not seen.problems,
                "problems": seen.problems,
                "warnings": seen.warnings,
                "actions": seen.actions,
            }
        )
        return
    warn(seen.warnings)
    steps = len({a.step for a in seen.actions})
    if not seen.changes and not seen.actions:
        console.print(f"{seen.app}: already at v{seen.release}: nothing to change", highlight=False)
        return
    head = f"v{seen.release} of {seen.app}" if seen.changes else f"{seen.app} stays at v{seen.release}"
    console.print(f"{head}: {len(seen.actions)} action(s) in {steps} step(s)", highlight=False)
    if not seen.actions:
        return
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("step", "region", "action", "machine", "worker", "role", "release"):
        table.add_column(col, no_wrap=True)
    table.add_column("reason", overflow="fold")
    for group in _alike(seen.actions):
        a = group[0]
        release = f"v{a.release}" if a.release is not None else "-"
        if a.from_release is not None and a.from_release != a.release:
            release = f"v{a.from_release} -> {release}"
        action = a.action + (" (restart)" if a.action == "update" and a.starts else "")
        machine = a.machine_id or a.new or "-"
        if len(group) > 1:
            action += f" x{len(group)}"
            machine = f"{group[0].new}..{group[-1].new}"
        table.add_row(str(a.step), a.region, action, machine, a.worker_id or "-", a.role or "-", release, a.reason)
    console.print(table)


def _alike(actions: list[Planned]) -> list[list[Planned]]:
    """Creates of the same step, region, role and reason, one after another, are one row (`create x38`)."""
    groups: list[list[Planned]] = []
    for a in actions:
        last = groups[-1][-1] if groups else None
        if (
            last is not None
            and a.action == last.action == "create"
            and (a.step, a.region, a.role, a.release, a.reason)
            == (last.step, last.region, last.role, last.release, last.reason)
        ):
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def reconcile(
    config: Path | None = typer.Option(None, "--config", "-c", help="an app spec: deploy it if it is new"),
    app: str | None = typer.Option(None, "--app", "-a", help="only this app", callback=check_app),
    watch: bool = typer.Option(False, "--watch", "-w", help="keep converging as things change (the operator)"),
    region: str | None = typer.Option(
        None,
        "--region",
        "-r",
        help="act on this region's machines only (a supercluster runs one operator per region)",
        callback=check_region,
    ),
    nats: str | None = NatsOption,
) -> None:
    """Bring apps to their current release: once, or continuously with --watch (all apps by default).

    The operator reacts to worker heartbeats expiring (spares start), machines' events and new
    releases; a timer is only a backstop. With --region it plans, starts and fails over in that region
    only, and keeps going on the last release it saw when the app specs do not answer (docs/how-to/supercluster.md).
    """
    spec = load_app_spec(config) if config is not None else None
    names = [spec.app] if spec is not None else [app] if app else None

    async def go(r: Reconciler) -> int:
        if spec is not None:
            current = await r.releases.current(spec.app)
            if current is None or current.spec != spec:
                try:
                    outcome = await rollout.deploy(r, spec, "reconcile: spec changed")
                except CannotDeploy as exc:
                    cannot_deploy(exc.app, exc.problems)
                console.print(outcome.message, highlight=False)
        if watch:
            return await _watch(r, names)
        failed = 0
        for name in names or await r.releases.apps():
            if names is None and await r.releases.head(name) is None:
                continue  # its only deploys failed: it has nothing to converge to
            result = await rollout.reconcile_once(r, name)
            console.print(
                f"{name}: {result.describe()} ({result.passes} passes, {result.seconds:.1f}s)", highlight=False
            )
            failed += not result.ok
        return 1 if failed else 0

    def connected(url: str) -> Awaitable[Reconciler]:
        return Reconciler.connect(url, region=region)

    code = (
        serve_connected(nats, connected, go, what="reconcile --watch") if watch else with_connected(nats, connected, go)
    )
    if code:
        raise typer.Exit(code)


async def _watch(r: Reconciler, names: list[str] | None) -> int:
    stop = asyncio.Event()  # never set: SIGINT and SIGTERM cancel the operator (`serve_connected`)

    def on_result(app: str, result: Result) -> None:
        stamp = time.strftime("%H:%M:%S")
        action = result.action
        outcome = "" if result.ok else f" (failed: {result.error})"
        target = result.machine_id or "new machine"
        console.print(
            f"{stamp} {app} {action.region}: {type(action).__name__.lower()} {target}: {action.reason}{outcome}",
            highlight=False,
        )

    r.on_result = on_result
    console.print(f"watching {', '.join(names) if names else 'all apps'} (Ctrl-C to stop)", highlight=False)
    await Operator(r).watch(names, stop)
    return 0
