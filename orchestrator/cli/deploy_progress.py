"""How a deploy, rollback or scale shows its progress and says how it ended.

A progress bar per region and a line per action while it runs (plain lines when the output is not a
terminal); then the outcome in one line, or one `fauxmad: ...` line per distinct error and a non-zero exit.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from orchestrator.cli.render import console, literal
from orchestrator.cli.runtime import fail_lines
from orchestrator.reconcile.actions import Plan
from orchestrator.reconcile.executor import Result
from orchestrator.reconcile.rollout import DeployOutcome


class DeployDisplay:
    """A progress bar per region (ready primaries of the release over the desired count) and a line per
    action; plain lines when the output is not a terminal."""

    def __init__(self, title: str) -> None:
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description:>10}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[note]}", markup=False),
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


def print_outcome(outcome: DeployOutcome) -> None:
    if outcome.ok:
        console.print(Text.assemble(literal(outcome.message, "green"), f" in {outcome.seconds:.1f}s"))
        return
    fail_lines(outcome.lines())


def cannot_deploy(app: str, problems: list[str]) -> NoReturn:
    fail_lines([f"cannot deploy {app}: {problem}" for problem in problems])
