"""`fauxmad launch [DIR]`: start a new app's `fauxmad.toml` from a directory, as `fly launch` does.

A flyctl user's first step is `fly launch` in the app's directory; fauxmad had no such step (a spec was
written by hand from the README). Launch looks for one of a few common shapes, each an HTTP service on
`$PORT`: a Node app (`package.json`: its `main`, else `server.js`/`index.js`/`app.js`), a Python app
(`app.py`, `main.py` or `server.py`), a static site (`index.html`, served by `python3 -m http.server`).
Anything else needs `--cmd`: there is no prompt (a command that asks is a command a script cannot run), so
a directory it cannot tell with no `--cmd` is one line and exit 2. It prints what it chose, writes the spec
(never over an existing one without `--force`) and deploys only with `--deploy`.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import msgspec
import typer

from orchestrator.cli.render import console, print_json
from orchestrator.cli.runtime import EXIT_USAGE, JsonOption, NatsOption, check_app, fail, split_names, with_client

SPEC_NAME = "fauxmad.toml"
PYTHON_FILES = ("app.py", "main.py", "server.py")
NODE_FILES = ("server.js", "index.js", "app.js")
STATIC_CMD = ["sh", "-c", 'exec python3 -m http.server --bind 127.0.0.1 "$PORT"']  # local: machines listen on loopback


class Choice(msgspec.Struct, kw_only=True):
    """What launch found in the directory and the command it will run."""

    kind: str  # python, node, static, or command (given with --cmd)
    found: str  # the file that told, or the --cmd given
    cmd: list[str]


def detect(directory: Path) -> Choice | None:
    """The shape of `directory`, or None when it is none of the few launch knows."""
    package = directory / "package.json"
    if package.is_file():
        try:
            main = json.loads(package.read_text()).get("main")
        except (OSError, ValueError, AttributeError):
            main = None
        candidates = [main] if isinstance(main, str) and main else []
        for name in [*candidates, *NODE_FILES]:
            if (directory / name).is_file():
                return Choice(kind="node", found=f"package.json, {name}", cmd=["node", name])
    for name in PYTHON_FILES:
        if (directory / name).is_file():
            return Choice(kind="python", found=name, cmd=["python3", name])
    if (directory / "index.html").is_file():
        return Choice(kind="static", found="index.html", cmd=STATIC_CMD)
    return None


def given_command(text: str) -> Choice:
    """`--cmd` in shell words; one that names `$PORT` runs in `sh -c` (no shell runs a machine's command)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        fail(f"--cmd {text!r}: {exc}", EXIT_USAGE)
    if not words:
        fail("--cmd is empty: give the command that starts the app", EXIT_USAGE)
    cmd = ["sh", "-c", f"exec {text}"] if "$PORT" in text or "${PORT}" in text else words
    return Choice(kind="command", found=text, cmd=cmd)


def app_name_for(directory: Path) -> str:
    """The directory's name as an app name: letters, digits, '-' and '_' (at most 64)."""
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", directory.resolve().name.lower()).strip("-_")[:64]
    return name or "app"


# where every key of fauxmad.toml is explained (tests/orchestrator/fleet/test_docs.py checks the page exists)
SPEC_REFERENCE = "every key: docs/reference/fauxmad-toml.md in fauxmad's repository"


def spec_text(app: str, choice: Choice, regions: dict[str, int], memory_mb: int) -> str:
    region_lines = "".join(f"{region} = {count}\n" for region, count in regions.items())
    return (
        f"# written by `fauxmad launch` ({choice.kind}: {choice.found}); edit freely\n"
        f"# {SPEC_REFERENCE}\n"
        f"app = {json.dumps(app)}\n"
        f"cmd = {json.dumps(choice.cmd)}\n"
        'workdir = "."                          # the command runs in this directory\n'
        "\n[guest]\ncpus = 1\n"
        f"memory_mb = {memory_mb}\n"
        f"\n[regions]\n{region_lines}"
        "\n[checks.http]                          # a deploy waits until GET / answers on $PORT\n"
        'type = "http"\npath = "/"\ninterval = "1s"\ntimeout = "2s"\n'
        "\n[http_service]                         # the edge proxy serves it as <app>.<domain>\n"
    )


def _default_region(nats: str | None) -> str:
    """The fleet's first region with a live worker (alphabetical): launch's region when none is given."""
    found = with_client(nats, lambda client: client.regions())
    live = sorted(r.region for r in found if r.workers > r.cordoned)
    if not live:
        fail("no --region given and the fleet has no region with a live worker: pass --region R", EXIT_USAGE)
    return live[0]


def launch(
    directory: Path = typer.Argument(Path("."), help="the app's directory (default: this one)"),
    name: str | None = typer.Option(
        None, "--name", "-a", help="the app's name (default: the directory's)", callback=check_app
    ),
    region: str | None = typer.Option(
        None, "--region", "-r", help="region(s), comma-separated (default: the fleet's first region with workers)"
    ),
    count: int = typer.Option(1, "--count", min=0, max=1000, help="machines per region"),
    cmd: str | None = typer.Option(
        None, "--cmd", help='the command that starts it (shell words; with "$PORT" it runs in sh -c)'
    ),
    memory_mb: int = typer.Option(256, "--memory-mb", min=1, help="memory per machine"),
    deploy: bool = typer.Option(False, "--deploy", help="then deploy it (as `fauxmad deploy -c DIR/fauxmad.toml`)"),
    force: bool = typer.Option(False, "--force", help=f"replace an existing {SPEC_NAME}"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Write DIR/fauxmad.toml for a new app: an HTTP service on $PORT for a Node app (package.json), a Python
    app (app.py, main.py, server.py) or a static site (index.html); anything else needs --cmd. Prints what it
    chose; deploys only with --deploy."""
    if not directory.is_dir():
        fail(f"{directory} is not a directory", EXIT_USAGE)
    choice = given_command(cmd) if cmd is not None else detect(directory)
    if choice is None:
        fail(
            f"cannot tell what {directory} runs (no package.json, {', '.join(PYTHON_FILES)} or index.html):"
            ' pass --cmd "the command that starts it"',
            EXIT_USAGE,
        )
    target = directory / SPEC_NAME
    if target.exists() and not force:
        fail(f"{target} exists: pass --force to replace it, or deploy it (fauxmad deploy -c {target})", EXIT_USAGE)
    app = name or app_name_for(directory)
    regions = split_names("region", region) if region else [_default_region(nats)]
    if not regions:
        fail(f"--region {region!r} names no region", EXIT_USAGE)
    text = spec_text(app, choice, {r: count for r in regions}, memory_mb)
    try:
        target.write_text(text)
    except OSError as exc:
        fail(f"cannot write {target}: {exc.strerror or exc}", EXIT_USAGE)
    chosen = {"app": app, "kind": choice.kind, "found": choice.found, "cmd": choice.cmd, "regions": regions}
    if json_out and not deploy:
        print_json({**chosen, "spec": str(target)})
    elif not json_out:
        console.print(
            f"{directory}: {choice.kind} ({choice.found}): an HTTP service on $PORT", highlight=False, soft_wrap=True
        )
        console.print(f"  cmd = {shlex.join(choice.cmd)}", highlight=False, soft_wrap=True)
        console.print(
            f"wrote {target} (app {app}, {', '.join(f'{r}={count}' for r in regions)})", highlight=False, soft_wrap=True
        )
        if not deploy:
            console.print(f"next: fauxmad deploy -c {target}", highlight=False, soft_wrap=True)
    if deploy:
        from orchestrator.cli.deploy_cmd import deploy as deploy_spec

        deploy_spec(
            config=target,
            dry_run=False,
            detach=False,
            json_out=json_out,
            image=None,
            finish_release=None,
            finish_app=None,
            nats=nats,
        )
