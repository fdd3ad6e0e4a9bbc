"""`fauxmad api`: serve the Machines API over HTTP (Fly's paths); parse the options, hand off to the library."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.cli.runtime import STATELESS_GRACE, NatsOption, fail, nats_url
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
    tls_cert: Path | None = typer.Option(
        None,
        "--tls-cert",
        help="serve HTTPS with this certificate (PEM, with its chain); with --tls-key. Default on a secure fleet: "
        "the one the fleet's CA issued to the API's identity",
    ),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="the private key of --tls-cert (PEM)"),
    no_tls: bool = typer.Option(
        False, "--no-tls", help="serve plain HTTP even on a secure fleet (behind a TLS-terminating proxy)"
    ),
    trusted_proxy: list[str] = typer.Option(
        [],
        "--trusted-proxy",
        help="an IP or CIDR whose X-Forwarded-Proto and X-Forwarded-Host count (a TLS-terminating proxy in front), "
        "repeatable; from any other peer they are ignored",
    ),
    nats: str | None = NatsOption,
) -> None:
    """Serve Fly's Machines API (`/v1/apps/...`) over HTTP, with a broker of its own: creates are placed here; and the
    web console at `/ui` (same tokens)."""
    from bus.contract.errors import BadRequest
    from orchestrator.api.run import fleet_certificate, read_root_key, read_token, serve, tls_context
    from orchestrator.console.guard import TrustedProxies, parse_proxy
    from orchestrator.console.routes import attach
    from orchestrator.proxy.run import parse_listen

    try:
        where = parse_listen(listen)
        token = read_token(token_file)
        root_key = read_root_key(token_key)
        metrics = parse_listen(metrics_listen) if metrics_listen else None
        trusted = [parse_proxy(value) for value in trusted_proxy]
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: give both, or neither")
        if no_tls and tls_cert is not None:
            raise ValueError("--no-tls and --tls-cert contradict each other: give one")
    except (ValueError, OSError) as exc:
        fail(str(exc), 2)
    url = nats_url(nats)
    assert url is not None
    try:
        pair = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        if pair is None and not no_tls:
            pair = fleet_certificate(url)
        tls = tls_context(*pair) if pair is not None else None
    except (ValueError, BadRequest) as exc:
        fail(str(exc), 2)
    at = (metrics.host, metrics.port) if metrics else None
    serve_until_stopped(
        serve(
            url,
            where.host,
            where.port,
            token=token,
            root_key=root_key,
            metrics=at,
            tls=tls,
            extend=lambda app, auth: attach(
                app, auth, proxy_metrics=proxy_metrics, trusted=TrustedProxies(trusted)
            ),  # the web console at /ui
        ),
        what="api",
        grace=STATELESS_GRACE,
    )
