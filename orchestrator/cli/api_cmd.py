"""`fauxmad api`: serve the Machines API over HTTP (Fly's paths); parse the options, hand off to the library."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.cli.runtime import NatsOption, fail, nats_url
from orchestrator.cli.runtime import serve as serve_until_stopped


def api(
    listen: str = typer.Option("127.0.0.1:4280", "--listen", help="HOST:PORT to serve HTTP on"),  # local: default
    token_file: Path | None = typer.Option(None, "--token-file", help="a file holding the bearer token to require"),
    token_key: Path | None = typer.Option(
        None,
        "--token-key",
        help="the fleet's token root key: accept tokens minted from it (`fauxmad token mint`): app-scoped, "
        "expiring, revocable",
    ),
    metrics_listen: str | None = typer.Option(None, "--metrics-listen", help="HOST:PORT for Prometheus /metrics"),
    proxy_metrics: list[str] = typer.Option(
        [],
        "--proxy-metrics",
        help="an edge proxy's /metrics URL (its --admin listener), repeatable: the console's app page shows its "
        "requests, autostarts and resumes",
    ),
    nats: str | None = NatsOption,
) -> None:
    """Serve Fly's Machines API (`/v1/apps/...`) over HTTP, with a broker of its own: creates are placed here; and the
    web console at `/ui` (same tokens)."""
    from orchestrator.api.run import read_root_key, read_token, serve
    from orchestrator.proxy.run import parse_listen

    try:
        where = parse_listen(listen)
        token = read_token(token_file)
        root_key = read_root_key(token_key)
        metrics = parse_listen(metrics_listen) if metrics_listen else None
    except (ValueError, OSError) as exc:
        fail(str(exc), 2)
    url = nats_url(nats)
    assert url is not None
    at = (metrics.host, metrics.port) if metrics else None
    serve_until_stopped(
        serve(url, where.host, where.port, token=token, root_key=root_key, metrics=at, proxy_metrics=proxy_metrics),
        what="api",
    )
