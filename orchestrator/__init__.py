"""The orchestrator side (flaps and flyctl's roles): broker, placement, reconcilers, view, CLI, TUI.

It reaches workers only over the bus (`bus`), never by importing `workers`; the one exception is
the CLI entry point, which may wire in the `fauxmad worker` command so one install runs every role.
"""

import bus  # noqa: F401  (first: it defers the aiohttp that nats-py imports and never uses)
