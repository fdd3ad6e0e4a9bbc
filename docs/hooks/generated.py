"""mkdocs hook: pages and documents generated from the code at build time (nothing here is written by hand).

- `reference/cli.md`: every `fauxmad` command, group and option, walked from the typer app's click tree;
- `reference/openapi.json`: the OpenAPI document `fauxmad api` serves at `/openapi.json`;
- `reference/asyncapi.json`: the NATS contract, as `fauxmad schema asyncapi` prints it;
- the architecture page's Layout (`on_page_markdown`): every package and module of the tree, each package said in
  the first sentence of its own docstring, so the page cannot go stale when a module is added, moved or removed.

They are added to the build (`on_files`), never written into docs/, so `mkdocs build --strict` checks the links
to them like any page's. `cli_reference` needs no mkdocs (tests/orchestrator/fleet/test_docs.py reads its pointers).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.structure.files import Files


def _usage(command: Any, ctx: Any) -> str:
    pieces = command.collect_usage_pieces(ctx)
    return " ".join([ctx.command_path, *pieces])


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _options(command: Any, ctx: Any) -> list[str]:
    rows = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            if param.param_type_name == "argument":
                rows.append(f"| `{param.human_readable_name}` | argument{' (required)' if param.required else ''} |")
            continue
        names, help_text = record
        rows.append(f"| `{_escape(names)}` | {_escape(help_text) or ' '} |")
    if not rows:
        return []
    return ["| option | what it does |", "|---|---|", *rows, ""]


def _walk(command: Any, ctx: Any, depth: int, out: list[str]) -> None:
    heading = "#" * min(depth + 1, 6)
    out.append(f"{heading} `{ctx.command_path}`\n")
    help_text = (command.help or command.short_help or "").strip()
    if help_text:
        out.append(help_text.replace("\b\n", "") + "\n")
    out.append(f"```\n{_usage(command, ctx)}\n```\n")
    out.extend(_options(command, ctx))
    if hasattr(command, "list_commands"):  # a group (typer carries its own click: no isinstance)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            _walk(sub, sub.context_class(sub, info_name=name, parent=ctx), depth + 1, out)


def cli_reference() -> str:
    import typer

    from orchestrator.cli import app as cli_app

    cli_app.register()  # every command (a call registers only the one it runs)
    root = typer.main.get_command(cli_app.app)
    out = [
        "# Every command\n",
        "Generated from the command line's own definitions when the site is built (`just docs`): the same text as "
        "`fauxmad COMMAND --help`. What each command is for, grouped by task: [Commands](commands.md).\n",
    ]
    _walk(root, root.context_class(root, info_name="fauxmad"), 1, out)
    return "\n".join(out) + "\n"


def _json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, sort_keys=False) + "\n"


ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("lab", "orchestrator", "workers", "bus")  # top to bottom: the arrows of the import contracts go down
LAYOUT_MARKER = "<!-- generated: layout -->"


def _first_sentence(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def _package_lines(package: Path, depth: int, out: list[str]) -> None:
    relative = package.relative_to(ROOT).as_posix()
    indent = "    " * depth
    out.append(f"{indent}- **`{relative}/`** {_first_sentence(package / '__init__.py')}")
    modules = sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__")
    if modules:
        out.append(f"{indent}    Modules: {', '.join(f'`{m}`' for m in modules)}.")
    for child in sorted(p.parent for p in package.glob("*/__init__.py")):
        _package_lines(child, depth + 1, out)


def layout() -> str:
    """The tree's packages and modules, from the code itself: what the Layout section of the architecture page shows."""
    out: list[str] = []
    for layer in LAYERS:
        _package_lines(ROOT / layer, 0, out)
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if LAYOUT_MARKER in markdown:
        return markdown.replace(LAYOUT_MARKER, layout())
    return markdown


def on_files(files: Files, config: Any) -> Files:
    from mkdocs.structure.files import File

    from bus.contract.schema import asyncapi
    from orchestrator.api.openapi import document

    for path, content in (
        ("reference/cli.md", cli_reference()),
        ("reference/openapi.json", _json(document())),
        ("reference/asyncapi.json", _json(asyncapi())),
    ):
        files.append(File.generated(config, path, content=content))
    return files
