"""`fauxmad deploy --detach`: the deploy goes on in a process of its own, and the command returns.

The command claims the release and points the app at it (so its number is known, and the feasibility
check holds), then starts `fauxmad deploy --finish-app APP --finish-release N` in a session of its own,
writing to a log file; that process converges the release (or rolls it back) and logs how it went.

The file is named after the fleet too (a digest of its NATS URL, as the view's cache file): two fleets on one
host (two `fauxmad dev`, a team's CI jobs) deploy the same app and release number, and appended to one file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgspec

from orchestrator.apps.spec import AppSpec
from orchestrator.cli.app_options import with_reconciler
from orchestrator.cli.deploy_progress import DeployDisplay, print_outcome
from orchestrator.cli.runtime import fail, nats_url
from orchestrator.reconcile import rollout
from orchestrator.reconcile.reconciler import Reconciler
from orchestrator.reconcile.rollout import DeployOutcome


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


async def start_detached(r: Reconciler, spec: AppSpec, nats: str | None) -> Detached:
    """Claim the release and point the app at it here (so its number is known and the feasibility check
    holds), then hand the rest (converge, roll back) to a process of its own, in its own session."""
    release = await rollout.begin(r, spec, "deploy (detached)")
    log_dir = _log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    url = nats_url(nats)
    assert url is not None
    fleet = hashlib.sha256(url.encode()).hexdigest()[:8]
    path = log_dir / f"deploy-{spec.app}-v{release.version}-{fleet}.log"
    args = [sys.executable, "-m", "orchestrator.cli", "deploy", "--nats", url]
    args += ["--finish-app", spec.app, "--finish-release", str(release.version)]
    with path.open("ab") as log:
        subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return Detached(release=release.version, log=str(path))


def finish_detached(app: str, version: int, nats: str | None) -> None:
    """The background half of `deploy --detach`: converge the release (or roll it back) and log how it went."""

    async def go(r: Reconciler) -> DeployOutcome | None:
        head = await r.releases.head(app)
        if head is None or head.version != version:
            return None
        release = await r.releases.get(app, version)
        with DeployDisplay(f"deploying {app} v{version} ({release.spec.deploy.strategy})") as show:
            r.on_plan, r.on_result = show.on_plan, show.on_result
            return await rollout.finish(r, release)

    outcome = with_reconciler(nats, go)
    if outcome is None:
        fail(f"v{version} of {app} is no longer current: left alone")
    print_outcome(outcome)
