"""`fauxmad proxy`: run an edge proxy (any number at once): parse the options, hand off to the library."""

from __future__ import annotations

import ipaddress

import typer

from orchestrator.cli.runtime import STATELESS_GRACE, NatsOption, checked, fail, nats_url, serve


def _latency(pairs: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs:
        region, _, ms = pair.partition("=")
        try:
            out[checked("region", region)] = float(ms)
        except ValueError:
            fail(f"--latency {pair!r}: use REGION=MILLISECONDS", 2)
    return out


def proxy(
    listen: str = typer.Option("127.0.0.1:8080", "--listen", help="HOST:PORT to serve HTTP on"),  # local: default
    region: str = typer.Option(..., "--region", help="the region this proxy stands in (its machines go first)"),
    domain: str = typer.Option("localhost", "--domain", help="apps are served at <app>.<domain>"),  # local: default
    admin: str | None = typer.Option(None, "--admin", help="HOST:PORT for /metrics and /healthz (off by default)"),
    latency: list[str] = typer.Option(
        [], "--latency", help="REGION=MS: how far another region is (repeat); unknown regions come last"
    ),
    machine_host: str | None = typer.Option(
        None,
        "--machine-host",
        help="deprecated: dial every machine's port at this host, whatever its worker advertises (a fleet of one "
        "host); by default a machine on this host is dialed on loopback and any other through its worker's backhaul",
        show_default=False,
    ),
    backhaul: str = typer.Option(
        "auto",
        "--backhaul",
        help="auto: machines on other hosts through their worker's backhaul, this host's directly; always: every "
        "machine through the backhaul (to measure or test it on one host)",
    ),
    queue_timeout: float = typer.Option(5.0, "--queue-timeout", min=0, help="seconds a request waits for a slot"),
    head_timeout: float = typer.Option(
        10.0, "--head-timeout", min=0.1, help="seconds a client has to send a whole request head (else 408)"
    ),
    response_timeout: float = typer.Option(
        60.0, "--response-timeout", min=0.1, help="seconds a machine has to begin its response (else 504)"
    ),
    trusted_proxy: list[str] = typer.Option(
        [],
        "--trusted-proxy",
        help="CIDR of a hop in front of this proxy whose Forwarded, X-Forwarded-*, X-Real-IP and"
        " Fly-Client-IP are believed (repeat); from anyone else they are dropped",
    ),
    nats: str | None = NatsOption,
) -> None:
    """Route HTTP requests for <app>.<domain> to the app's machines; start or create them inside a request."""
    from orchestrator.proxy.config import ProxyConfig
    from orchestrator.proxy.run import parse_listen, run_proxy

    try:
        where = parse_listen(listen)
        admin_at = parse_listen(admin) if admin else None
    except ValueError as exc:
        fail(str(exc), 2)
    for cidr in trusted_proxy:
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            fail(f"--trusted-proxy {cidr!r}: use an address or a CIDR such as 10.0.0.0/8", 2)
    if backhaul not in ("auto", "always"):
        fail(f"--backhaul {backhaul!r}: use auto or always", 2)
    config = ProxyConfig(
        region=checked("region", region),
        domain=domain,
        machine_host=machine_host,
        backhaul_always=backhaul == "always",
        latency=_latency(latency),
        queue_timeout=queue_timeout,
        head_timeout=head_timeout,
        response_timeout=response_timeout,
        trusted_proxies=tuple(trusted_proxy),
    )
    url = nats_url(nats)
    assert url is not None
    serve(run_proxy(config, url, where, admin=admin_at), what="proxy", grace=STATELESS_GRACE)
