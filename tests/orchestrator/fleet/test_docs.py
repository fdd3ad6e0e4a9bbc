"""The documentation (README.md and docs/, the mkdocs site) holds what it says: no link leaves the repository,
the README stays short and its first hour is the tutorial's, no lab diary, every metric is listed, and the
how-tos' blocks run (on a dev fleet) or, where they need root and real hosts, name files and options that exist.

`just docs` (mkdocs build --strict, in CI) checks every link between pages; this checks what mkdocs cannot.
The other pages' blocks run in the tests that read them: the first hour in test_readme, images, sandboxes and
volumes in test_images, test_sandbox_fleet and test_volumes, the secure fleet in test_security_matrix and
test_secrets, the supercluster in test_dev_supercluster, jobs in test_jobs_readme, tokens in test_api.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT
from tests.orchestrator.fleet.test_readme import README, first_hour_blocks, shell_env

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
                assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


# Pointers to nowhere: the pages docs/hooks/generated.py adds to the built site exist nowhere in the repository
GENERATED = ("reference/cli.md", "reference/openapi.json", "reference/asyncapi.json")
# the README's sections as cited: README "X", README 'X', the README's "X"
README_SECTION = re.compile(r"""README(?:'s)? (["'])([A-Z][^"'\n]*)\1""")
# a page of the docs cited by its path from the repository's root, with its anchor if any
DOCS_PATH = re.compile(r"\bdocs/([\w./-]+\.md)(?:#([\w-]+))?")
# what installs put inside the tree (`npm ci` of tests/bus/asyncapi in .ci/run, caches): other projects' text
INSTALLED = frozenset({"node_modules", "__pycache__"})
SOURCES = [
    p
    for top in ("bus", "orchestrator", "workers", "lab", "tests", "deploy", "docs", "examples")
    for p in sorted((ROOT / top).rglob("*"))
    if p.suffix in {".py", ".md", ".html", ".js", ".toml", ".conf", ".service", ".yml"}
    and p.is_file()
    and not INSTALLED & set(p.relative_to(ROOT).parts)
] + [README, ROOT / "pyproject.toml", ROOT / "justfile"]


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()).strip()
    return re.sub(r"[-\s]+", "-", text.lower())


def headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a `# comment` in a block is no heading
    return [h.strip() for h in re.findall(r"^#+ (.+)$", text, re.M)]


def dangling(text: str) -> list[str]:
    """The README sections and docs pages (and their anchors) `text` cites that do not exist."""
    sections = headings(README)
    missing = [
        f'README "{name}"' for _, name in README_SECTION.findall(text) if not any(h.startswith(name) for h in sections)
    ]
    for page, anchor in DOCS_PATH.findall(text):
        if page.startswith(GENERATED) or not (DOCS / page).is_file():
            missing.append(f"docs/{page}")
        elif anchor and anchor not in {slug(h) for h in headings(DOCS / page)}:
            missing.append(f"docs/{page}#{anchor}")
    return missing


def test_every_readme_section_and_docs_page_cited_exists() -> None:
    """In code, comments, docs and deploy/: a citation of a README section or a docs page names one that is."""
    assert len(SOURCES) > 100
    for path in [p for p in SOURCES if p != Path(__file__)]:  # this file's own examples are meant to fail
        missing = dangling(path.read_text(errors="replace"))
        assert not missing, f"{path.relative_to(ROOT)} cites {missing}, which do not exist"
    assert dangling('README "Volumes", docs/how-to/missing.md, docs/reference/exit-codes.md#nowhere') == [
        'README "Volumes"',
        "docs/how-to/missing.md",
        "docs/reference/exit-codes.md#nowhere",
    ]  # the check itself can fail
    assert dangling('README "The first hour", docs/reference/exit-codes.md#stopping') == []


def test_the_deploy_readme_links_and_installs_what_exists() -> None:
    deploy = ROOT / "deploy" / "README.md"
    text = deploy.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (deploy.parent / target).exists(), f"deploy/README.md links to {target}, which does not exist"
    for name in re.findall(r"`(?:deploy/)?((?:nats|systemd|prometheus|grafana)/[\w./<>-]*\w)`", text):
        if "<" not in name:
            assert (deploy.parent / name).exists(), f"deploy/README.md names {name}"
    assert not re.search(r"pip install fauxmad\b", text), "fauxmad is not on PyPI: install from a clone"


def test_no_page_in_the_repository_links_a_generated_page() -> None:
    """They exist only in the built site: a reader of the repository follows such a link to a 404."""
    for path in [README, *PAGES, ROOT / "deploy" / "README.md"]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            assert not target.endswith(GENERATED), f"{path.relative_to(ROOT)} links to {target} (built site only)"


def generated_pages() -> Any:
    spec = importlib.util.spec_from_file_location("generated_pages", DOCS / "hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generated_cli_reference() -> str:
    return str(generated_pages().cli_reference())


def test_the_architecture_pages_layout_names_every_package_and_module() -> None:
    """The Layout is generated from the tree: a module added anywhere shows, and nothing is listed by hand."""
    page = (DOCS / "explanation" / "architecture.md").read_text()
    hooks = generated_pages()
    assert hooks.LAYOUT_MARKER in page
    layout = hooks.layout()
    for layer in hooks.LAYERS:
        for path in (ROOT / layer).rglob("*.py"):
            if "node_modules" in path.parts:
                continue
            package = path.parent.relative_to(ROOT).as_posix()
            assert f"**`{package}/`**" in layout, f"the Layout leaves out {package}/"
            if path.stem != "__init__":
                listed = re.search(rf"\*\*`{re.escape(package)}/`\*\*.*\n\s+Modules: (.*)\n", layout)
                assert listed and f"`{path.stem}`" in listed.group(1), f"the Layout leaves out {package}/{path.name}"


def test_what_the_cli_and_the_api_print_points_somewhere(tmp_path: Path) -> None:
    """Every command's help (the generated page), the API's /docs page, the spec `launch` writes: each README
    section, docs page and command they name exists."""
    from orchestrator.api.openapi import DOCS_HTML
    from orchestrator.cli.launch_cmd import Choice, spec_text

    reference = generated_cli_reference()
    assert "### `fauxmad dev`" in reference and "--supercluster" in reference
    launched = spec_text("app", Choice(kind="command", found="true", cmd=["true"]), {"mad": 1}, 256)
    for where, text in (("the CLI's help", reference), ("/docs", DOCS_HTML), ("launch's spec", launched)):
        assert not dangling(text), f"{where} cites {dangling(text)}"
        bare = re.findall(r"[^\n]*\bREADME\b(?!(?:'s)? [\"'])[^\n]*", text)
        assert not bare, f"{where} points to the README without a section: {bare}"
    assert "docs/reference/fauxmad-toml.md" in launched and "docs/reference/http-api.md" in DOCS_HTML
    commands = set(re.findall(r"^#+ `(fauxmad[\w -]*)`", reference, re.M))
    named = re.findall(r"`(fauxmad(?: [a-z][a-z-]*)+)", reference + DOCS_HTML + launched)
    for command in named:  # the longest prefix of what is named that is a command
        words = command.split()
        assert any(" ".join(words[:n]) in commands for n in range(len(words), 1, -1)), f"no command `{command}`"
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", reference):  # the generated page's own links
        assert (DOCS / "reference" / link).exists(), f"the generated reference/cli.md links to {link}"


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
