"""The documentation (README.md and docs/, the mkdocs site) holds what it says: no link leaves the repository,
the README stays short and its first hour is the tutorial's, no lab diary, every metric is listed, and the
how-tos' blocks run (on a dev fleet) or, where they need root and real hosts, name files and options that exist.

`just docs` (mkdocs build --strict, in CI) checks every link between pages; this checks what mkdocs cannot.
The other pages' blocks run in the tests that read them: the first hour in test_readme, images, sandboxes and
volumes in test_images, test_sandbox_fleet and test_volumes, the secure fleet in test_security_matrix and
test_secrets, the supercluster in test_dev_supercluster, jobs in test_jobs_readme, tokens in test_api.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT
from tests.orchestrator.test_readme import README, first_hour_blocks, shell_env

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
TEXTS = [README, *PAGES]


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)


def test_no_link_leaves_the_repository() -> None:
    for path in TEXTS:
        text = path.read_text()
        assert "../shared" not in text, f"{path.relative_to(ROOT)} names ../shared (outside the repository)"
        external = re.findall(r"\]\((?:https?:)?//[^)]*\)|<https?://[^>]*>", text)
        assert not external, f"{path.relative_to(ROOT)} links outside the repository: {external}"
        if path == README:  # mkdocs checks the pages' links; the README's are checked here
            for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
                generated = target == "docs/reference/cli.md"  # made by docs/hooks/generated.py at build time
                assert generated or (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_the_readme_is_short_and_its_first_hour_is_the_tutorial() -> None:
    assert len(README.read_text().splitlines()) <= 200
    tutorial = (DOCS / "tutorials" / "first-hour.md").read_text().replace("## The edge:", "### The edge:")
    assert first_hour_blocks(tutorial.replace("# The first hour", "## The first hour", 1)) == first_hour_blocks()


def test_no_lab_diary() -> None:
    for path in TEXTS:
        diary = re.findall(r"\b(?:at|since|from|in) stop[ -]\d+|\bstop \d+'s\b|\bstop-\d+\b", path.read_text())
        assert not diary, f"{path.relative_to(ROOT)}: {diary}"


def test_every_metric_is_documented() -> None:
    page = (DOCS / "reference" / "metrics.md").read_text()
    sources = ["orchestrator/api/metrics.py", "orchestrator/broker/metrics.py", "orchestrator/proxy/metrics.py"]
    names = {
        n for src in [*sources, "workers/metrics.py"] for n in re.findall(r'"(fauxmad_\w+)"', (ROOT / src).read_text())
    }
    assert len(names) >= 20
    assert not [n for n in names if f"`{n}" not in page], "metrics missing from docs/reference/metrics.md"


def test_the_host_how_tos_name_files_and_options_that_exist() -> None:
    """Blocks that need root and real hosts (systemd, /etc) cannot run here: what they name must exist."""
    for page in ("several-hosts.md", "operations.md"):
        path = DOCS / "how-to" / page
        for name in re.findall(r"`?(deploy/[\w./-]+\w)", path.read_text()):
            assert (ROOT / name).exists(), f"{page} names {name}"
        for block in blocks(path, "sh"):
            for line in block.splitlines():
                for command in re.findall(r"(?:^|&& |\)\s*)((?:FAUXMAD_\w+=\S+ )?fauxmad [^&|;]*)", line):
                    words = [w for w in shlex.split(command) if "=" not in w or w.startswith("-")]
                    path_words = [w for w in words[1:] if re.fullmatch(r"[a-z][a-z-]*", w)][:2]
                    options = [w.split("=")[0] for w in words if w.startswith("--")]
                    helped = fauxmad_help(path_words)
                    missing = [o for o in options if o not in helped]
                    assert not missing, f"{page}: `{command}`: no option {missing}"


def fauxmad_help(words: list[str]) -> str:
    env = shell_env()
    for n in (len(words), len(words) - 1, 0):  # the longest prefix that is a command
        done = subprocess.run(["fauxmad", *words[:n], "--help"], capture_output=True, text=True, env=env, timeout=60)
        if done.returncode == 0:
            return done.stdout
    raise AssertionError(f"fauxmad {' '.join(words)}: no such command")


@pytest.mark.fleet
@pytest.mark.timeout(300)
def test_the_operations_blocks_run_as_written(tmp_path: Path) -> None:
    """docs/how-to/operations.md: drain a host, and the backup block, on the dev fleet it names."""
    runnable = blocks(DOCS / "how-to" / "operations.md", "bash")
    assert len(runnable) == 2, runnable
    with DevFleet(FleetSpec(regions=["mad", "syd"], workers_per_region=2)) as fleet:
        env = shell_env(FAUXMAD_HOME=str(tmp_path / "home"), FAUXMAD_NATS_URL=fleet.url)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
        for block in runnable:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-xc", block],
                capture_output=True, text=True, env=env, timeout=240, cwd=str(ROOT),
            )  # fmt: skip
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            if "drain" in block:  # the listing after the drain: every machine on the other worker
                rows = [line for line in done.stdout.splitlines() if "hello-edge-" in line]
                assert rows and not [r for r in rows if " mad-w1 " in r], done.stdout[-3000:]
