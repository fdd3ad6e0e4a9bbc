"""`fauxmad schema asyncapi|json`: the NATS contract, machine-readable (generated in `bus.contract.schema`)."""

from __future__ import annotations

import typer

from orchestrator.cli.render import print_json

schema_app = typer.Typer(help="The NATS contract as AsyncAPI 3.0 and JSON Schema, generated from the code.")


@schema_app.command("asyncapi")
def asyncapi_command() -> None:
    """Print the AsyncAPI 3.0 document of every subject (JSON)."""
    from bus.contract.schema import asyncapi

    print_json(asyncapi())


@schema_app.command("json")
def json_command(channel: str | None = typer.Argument(None, help="one channel's schemas (default: all)")) -> None:
    """Print the JSON Schemas (2020-12) of every message, or one channel's payload and reply."""
    from bus.contract.schema import json_schemas
    from orchestrator.cli.runtime import fail

    by_channel, components = json_schemas()
    if channel is None:
        print_json({"channels": by_channel, "components": {"schemas": components}})
        return
    if channel not in by_channel:
        fail(f"unknown channel {channel!r}: `fauxmad schema json` lists them all", 2)
    print_json({**by_channel[channel], "components": {"schemas": components}})
