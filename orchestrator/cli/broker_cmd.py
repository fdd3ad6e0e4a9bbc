"""`fauxmad broker`: run a stateless broker (any number at once, queue group `brokers`)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import typer

from orchestrator.cli.runtime import MetricsOption, NatsOption, fail, nats_url, serve, serve_metrics, shown_url

if TYPE_CHECKING:
    from orchestrator.broker.service import BrokerConfig


def broker(
    nats: str | None = NatsOption,
    deadline_ms: float = typer.Option(50.0, "--deadline-ms", min=1, max=60_000, help="how long an auction waits"),
    strategy: str = typer.Option(
        "scatter",
        "--strategy",
        help="default strategy: scatter, p2c, hedged or replica (docs/explanation/placement.md)",
    ),
    placement: Path | None = typer.Option(None, "--placement", help="TOML or JSON file: curves and weights"),
    name: str = typer.Option("", "--name", help="a name for this broker (shown in discovery)"),
    region: str | None = typer.Option(
        None, "--region", help="in a supercluster, the region this broker runs in (its state is read there first)"
    ),
    metrics_listen: str | None = MetricsOption,
) -> None:
    """Run a broker: turns `create` into a placement within milliseconds, or a clear 503 just as fast."""
    from orchestrator.broker.auction import STRATEGIES, AuctionConfig
    from orchestrator.broker.service import BrokerConfig
    from orchestrator.placement import PlacementConfig

    if strategy not in STRATEGIES:
        fail(f"unknown --strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    placement_config = PlacementConfig()
    if placement is not None:
        try:
            text = placement.read_bytes()
            data = tomllib.loads(text.decode()) if placement.suffix == ".toml" else msgspec.json.decode(text)
            placement_config = PlacementConfig.from_mapping(data)
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            fail(f"--placement {placement}: {exc}")
    serve_metrics(metrics_listen)
    url = nats_url(nats)
    assert url is not None
    config = BrokerConfig(
        nats_url=url,
        name=name,
        region=region,
        auction=AuctionConfig(deadline=deadline_ms / 1000, strategy=strategy, placement=placement_config),
    )
    serve(_serve(config), what="broker")


async def _serve(config: BrokerConfig) -> None:
    """`orchestrator.broker.service.run_broker`, saying what it serves once it does (as every server command)."""
    from bus.contract import subjects
    from orchestrator.broker.service import Broker, run_broker

    def ready(broker: Broker) -> None:
        print(
            f"fauxmad broker {broker.id}: serving {subjects.PREFIX}.api.> (queue group brokers) on"
            f" {shown_url(config.nats_url)}, strategy {config.auction.strategy},"
            f" deadline {config.auction.deadline * 1000:g} ms",
            flush=True,
        )

    await run_broker(config, ready)
