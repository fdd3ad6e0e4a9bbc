"""`python -m orchestrator.cli`: the same as the `fauxmad` command (used by tests and `fauxmad dev`)."""

from orchestrator.cli.app import main

main()
