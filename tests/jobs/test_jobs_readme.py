"""The "Background jobs" how-to's block (docs/how-to/jobs.md) runs as written, against a dev fleet like the one it names."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT
from tests.orchestrator.fleet.test_readme import shell_env

PAGE = ROOT / "docs" / "how-to" / "jobs.md"


def jobs_block() -> str:
    section = PAGE.read_text().split("## Background jobs", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)[0]


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.timeout(300)
def test_the_background_jobs_block_runs_as_written(tmp_path: Path) -> None:
    block = jobs_block()
    with DevFleet(FleetSpec(regions=["mad", "syd"], workers_per_region=2)) as fleet:
        env = shell_env(FAUXMAD_HOME=str(tmp_path / "home"), FAUXMAD_NATS_URL=fleet.url)
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-xc", block], capture_output=True, text=True, env=env, timeout=240
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("succeeded") >= 4  # the three of the first line and the flaky one
    assert "cancelled" in done.stdout
