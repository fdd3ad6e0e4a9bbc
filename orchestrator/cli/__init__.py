"""The `fauxmad` command line: thin commands that parse, call the library and render.

typer and rich live only in this package (and the TUI). Errors reach the user as one plain line
and a non-zero exit, never a traceback: `main` is the one edge where that happens.
"""

from orchestrator.cli.app import main

__all__ = ["main"]
