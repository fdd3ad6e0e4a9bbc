"""The lab's commands, `fauxmad bench`, `fauxmad sim` and `fauxmad torture`: a plugin of the command line.

They are registered through the `fauxmad.commands` entry point group (pyproject.toml), which the CLI reads, so the
product (`orchestrator`) never imports the lab that measures it: the lab stands on the product, never the reverse.
They parse options and print with the CLI's own helpers (`orchestrator.cli.render`, `runtime`), like any command.
"""
