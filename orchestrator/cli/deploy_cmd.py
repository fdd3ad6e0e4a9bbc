"""`fauxmad deploy`, `rollback`, `releases`, `reconcile`, `scale` and `apps`: the client-side reconcilers.

Each command is a thin edge over `orchestrator.reconcile.reconciler`: parse and check the input (a bad
spec is one line naming the key, before anything touches the fleet), connect, run the loop with a
progress display, and turn the outcome into an exit code.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec
import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bus.stores.images import ImageError
from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import (
    CliError,
    JsonOption,
    NatsOption,
    WorkerIdArgument,
    check_app,
    check_region,
    check_regions,
    check_worker_id,
    checked,
    fail,
    nats_url,
    split_names,
    with_client,
    with_connected,
)
from orchestrator.images import pin_image
from orchestrator.reconcile.executor import Result
from orchestrator.reconcile.plan import Plan
from orchestrator.reconcile.preview import Planned
from orchestrator.reconcile.reconciler import SCALED, CannotDeploy, DeployOutcome, Preview, Reconciler
from orchestrator.reconcile.releases import Release
from orchestrator.reconcile.spec import AppSpec, SpecError, load_spec

T = TypeVar("T")

CONFIG = typer.Option(Path("fauxmad.toml"), "--config", "-c", help="the app spec file")
APP = typer.Option(..., "--app", "-a", help="the app", callback=check_app)

scale_app = typer.Typer(help="Change how many machines an app runs (a new release, no restarts).", no_args_is_help=True)
apps_app = typer.Typer(help="The apps that have releases in KV fauxmad_apps.", no_args_is_help=True)


def with_reconciler(url: str | None, fn: Callable[[Reconciler], Awaitable[T]]) -> T:
    return with_connected(url, Reconciler.connect, fn)


def _spec(path: Path) -> AppSpec:
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


class DeployDisplay:
    """A progress bar per region (ready primaries of the release over the desired count) and a line per
    action; plain lines when the output is not a terminal."""

    def __init__(self, title: str) -> None:
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not self.live,
        )
        self.tasks: dict[str, Any] = {}
        self.title = title
        self.last: dict[str, tuple[int, int]] = {}
        self.failed: dict[str, int] = {}  # each distinct failure is shown once, then counted

    def __enter__(self) -> DeployDisplay:
        console.print(self.title, highlight=False)
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
        again = sum(n - 1 for n in self.failed.values())
        if again:
            console.print(f"({again} more failed action(s) like those above)", highlight=False)

    def on_plan(self, app: str, plan: Plan) -> None:
        for status in plan.regions:
            spares = f"spares {status.spares}/{status.spares_wanted}" if status.spares_wanted else ""
            if status.region not in self.tasks:
                self.tasks[status.region] = self.progress.add_task(status.region, total=status.desired or 1, note="")
            self.progress.update(
                self.tasks[status.region], completed=status.ready, total=max(status.desired, 1), note=spares
            )
            if not self.live and self.last.get(status.region) != (status.ready, status.spares):
                self.last[status.region] = (status.ready, status.spares)
                console.print(f"{status.region:>10}: {status.ready}/{status.desired} ready {spares}".rstrip())

    def on_result(self, app: str, result: Result) -> None:
        action = result.action
        name = type(action).__name__.lower()
        target = result.machine_id or "new machine"
        line = f"{action.region:>10}: {name} {target}: {action.reason}"
        if not result.ok:
            key = f"{action.region} {name} {re.sub(r'[0-9a-f]{14}|[0-9]+', '#', result.error)}"
            self.failed[key] = self.failed.get(key, 0) + 1
            if self.failed[key] > 1:
                return
            line += f" (failed: {result.error})"
        self.progress.console.print(line, highlight=False, markup=False)


def fail_lines(lines: list[str], code: int = 1) -> NoReturn:
    """Fail with one line per distinct error, each `fauxmad: ...` (the last through the CLI's edge)."""
    for line in lines[:-1]:
        typer.echo(f"fauxmad: {line}", err=True)
    fail(lines[-1], code)


def warn(lines: list[str]) -> None:
    for line in lines:
        typer.echo(f"fauxmad: warning: {line}", err=True)


def _finish(outcome: DeployOutcome) -> None:
    if outcome.ok:
        console.print(f"[green]{outcome.message}[/] in {outcome.seconds:.1f}s", highlight=False)
        return
    fail_lines(outcome.lines())


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


def _cannot(app: str, problems: list[str]) -> NoReturn:
    fail_lines([f"cannot deploy {app}: {problem}" for problem in problems])


def deploy(
    config: Path = CONFIG,
    dry_run: bool = typer.Option(False, "--dry-run", help="show every step the deploy would take; change nothing"),
    detach: bool = typer.Option(False, "--detach", help="start the deploy and return; it goes on in the background"),
    json_out: bool = typer.Option(False, "--json", help="print the outcome (or, with --dry-run, the plan) as JSON"),
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
        _finish_detached(finish_app, finish_release, nats)
        return
    spec = _spec(config)

    async def go(r: Reconciler) -> tuple[Preview, DeployOutcome | Detached | None]:
        nonlocal spec
        if spec.image is not None or spec.build is not None:
            try:
                spec = await pin_image(r.jetstream(), spec, say=lambda line: None if json_out else print(line))
            except ImageError as exc:
                fail(str(exc), 2)
        seen = await r.preview(spec)
        if dry_run or seen.problems:
            return seen, None
        if detach and seen.changes:
            return seen, await _detach(r, spec, nats)
        if json_out or not (seen.changes or seen.actions):  # nothing to show progress of
            return seen, await r.deploy(spec, checked=seen)
        warn(seen.warnings)
        with DeployDisplay(f"deploying {spec.app} ({spec.deploy.strategy}) to {', '.join(spec.regions)}") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return seen, await r.deploy(spec, checked=seen)

    try:
        seen, outcome = with_reconciler(nats, go)
    except CannotDeploy as exc:  # the fleet changed between the preview and the deploy
        _cannot(exc.app, exc.problems)
    if dry_run:
        _show_preview(seen, json_out)
    if seen.problems:
        _cannot(spec.app, seen.problems)
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
    _finish(outcome)


def _log_dir() -> Path:
    """Where detached deploys write: $FAUXMAD_HOME/logs, else $XDG_STATE_HOME/fauxmad/logs (~/.local/state)."""
    home = os.environ.get("FAUXMAD_HOME")
    if home:
        return Path(home) / "logs"
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "fauxmad" / "logs"


class Detached(msgspec.Struct, frozen=True, kw_only=True):
    release: int
    log: str


async def _detach(r: Reconciler, spec: AppSpec, nats: str | None) -> Detached:
    """Claim the release and point the app at it here (so its number is known and the feasibility check
    holds), then hand the rest (converge, roll back) to a process of its own, in its own session."""
    release = await r.begin(spec, "deploy (detached)")
    log_dir = _log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"deploy-{spec.app}-v{release.version}.log"
    url = nats_url(nats)
    assert url is not None
    args = [sys.executable, "-m", "orchestrator.cli", "deploy", "--nats", url]
    args += ["--finish-app", spec.app, "--finish-release", str(release.version)]
    with path.open("ab") as log:
        subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return Detached(release=release.version, log=str(path))


def _finish_detached(app: str, version: int, nats: str | None) -> None:
    """The background half of `deploy --detach`: converge the release (or roll it back) and log how it went."""

    async def go(r: Reconciler) -> DeployOutcome | None:
        head = await r.releases.head(app)
        if head is None or head.version != version:
            return None
        release = await r.releases.get(app, version)
        with DeployDisplay(f"deploying {app} v{version} ({release.spec.deploy.strategy})") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return await r.finish(release)

    outcome = with_reconciler(nats, go)
    if outcome is None:
        fail(f"v{version} of {app} is no longer current: left alone")
    _finish(outcome)


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
        _, target = await r.rollback_target(app, version, force=force)  # refused before anything is shown
        with DeployDisplay(f"rolling {app} back to v{target.version}") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return await r.rollback(app, target.version, force=force)

    _finish(with_reconciler(nats, go))


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def releases(app: str = APP, nats: str | None = NatsOption, json_out: bool = JsonOption) -> None:
    """An app's releases, newest first, with status and the current one marked."""

    async def go(r: Reconciler) -> tuple[list[Release], int]:
        head = await r.releases.head(app)
        return await r.releases.list(app), head.version if head else 0

    found, current = with_reconciler(nats, go)
    found.reverse()
    if json_out:
        print_json({"app": app, "current": current or None, "releases": found})
        return
    if not found:
        console.print(f"app {app} has no releases (deploy it with `fauxmad deploy -c fauxmad.toml`)")
        return
    # reasons go under the table, wrapped: one long reason must not squeeze every column to nothing
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("version", "status", "strategy", "regions", "created", "description"):
        table.add_column(col, no_wrap=True, overflow="ellipsis")
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
            console.print(f"* v{rel.version} {rel.status}: {rel.reason}", highlight=False, markup=False)


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
    only, and keeps going on the last release it saw when the app specs do not answer (README "Beyond one
    server: a supercluster").
    """
    spec = _spec(config) if config is not None else None
    names = [spec.app] if spec is not None else [app] if app else None

    async def go(r: Reconciler) -> int:
        if spec is not None:
            current = await r.releases.current(spec.app)
            if current is None or current.spec != spec:
                try:
                    outcome = await r.deploy(spec, "reconcile: spec changed")
                except CannotDeploy as exc:
                    _cannot(exc.app, exc.problems)
                console.print(outcome.message, highlight=False)
        if watch:
            return await _watch(r, names)
        failed = 0
        for name in names or await r.releases.apps():
            if names is None and await r.releases.head(name) is None:
                continue  # its only deploys failed: it has nothing to converge to
            result = await r.reconcile_once(name)
            console.print(
                f"{name}: {result.describe()} ({result.passes} passes, {result.seconds:.1f}s)", highlight=False
            )
            failed += not result.ok
        return 1 if failed else 0

    code = with_connected(nats, lambda url: Reconciler.connect(url, region=region), go)
    if code:
        raise typer.Exit(code)


async def _watch(r: Reconciler, names: list[str] | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

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
    await r.watch(names, stop)
    return 0


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
        current = await r.releases.current(app)
        if current is None:
            fail(f"app {app} has no current release: deploy it first")
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
            return await r.deploy(spec, f"{SCALED}count {count} ({summary})", always=True)

    try:
        outcome = with_reconciler(nats, go)
    except CannotDeploy as exc:
        _cannot(exc.app, exc.problems)
    _finish(outcome)


@apps_app.command("list")
def apps_list(nats: str | None = NatsOption, json_out: bool = JsonOption) -> None:
    """Apps with their current release and desired counts."""

    async def go(r: Reconciler) -> list[dict[str, Any]]:
        out = []
        for name in await r.releases.apps():
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
        console.print("no apps (deploy one with `fauxmad deploy -c fauxmad.toml`)")
        return
    table = Table(header_style="bold", box=box.SIMPLE_HEAD)
    for col in ("app", "release", "status", "strategy", "regions"):
        table.add_column(col, no_wrap=True)
    for row in found:
        regions = ",".join(f"{k}={v}" for k, v in row["regions"].items())
        release = f"v{row['release']}" if row["release"] is not None else "-"
        status = row["status"] or "no current release"
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
        return await r.destroy_app(app)

    result = with_reconciler(nats, go)
    if not result.ok:
        fail(f"destroying {app}: {result.describe()}")
    console.print(f"app {app} destroyed")


def drain(
    worker_id: str = typer.Argument(..., help="the worker to empty", callback=check_worker_id),
    timeout: float = typer.Option(300.0, "--timeout", min=1, help="give up after this many seconds"),
    nats: str | None = NatsOption,
) -> None:
    """Cordon a worker and move its machines elsewhere in its region, healthy replacements first.

    Maintenance without downtime: each primary gets a replacement on another worker, and stops only
    once that one passes its checks; spares are re-created elsewhere.
    """

    async def go(r: Reconciler) -> int:
        try:
            return await r.drain(worker_id, timeout=timeout, progress=lambda line: console.print(line, highlight=False))
        except TimeoutError as exc:
            fail(f"drain of {worker_id} incomplete: {exc}")

    started = time.perf_counter()
    moved = with_reconciler(nats, go)
    console.print(
        f"{worker_id} is drained: {moved} machine(s) moved in {time.perf_counter() - started:.1f}s "
        f"(it stays cordoned; `fauxmad worker uncordon {worker_id}` to use it again)",
        highlight=False,
    )


def cordon(worker_id: str = WorkerIdArgument, uncordon: bool = False, nats: str | None = NatsOption) -> None:
    """Stop (or resume) placing new machines on a worker; what runs there keeps running."""
    info = with_client(nats, lambda c: c.cordon(worker_id, cordoned=not uncordon))
    console.print(
        f"{info.worker_id} ({info.region}) is {'cordoned' if info.cordoned else 'taking machines'}", highlight=False
    )
