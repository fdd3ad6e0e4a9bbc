"""A NATS supercluster: one cluster per region (routes inside), regions joined by gateways.

Beyond one machine fauxmad runs on an existing distributed engine rather than a home-made one: each
region is a nats-server cluster (three servers, JetStream replicated R3 inside it), and the clusters
are joined into a supercluster by gateways, so any subject reaches any region while every region's
streams and buckets live on its own servers (`bus.transport.layout`).

`render_config` writes one server's config; the files under `deploy/nats/supercluster/` are its output
for hosts named `<region>-<n>` (a test keeps them equal), and `LoopbackSupercluster` runs the same layout
on 127.0.0.1 for `fauxmad dev --supercluster` and the tests, each server on its own free ports.

Partitions on loopback: nats-server cannot drop its gateways on a reload, and blocking a port needs root.
So a loopback supercluster may put a `GatewayRelay` (`bus.local.gateway_relay`) in front of each server's
gateway port, every gateway URL (and the one each server advertises) pointing at the relay; `cut(region)`
then closes and refuses every gateway connection into or out of that region, a real TCP partition that
leaves the region's routes and client connections alone, and `heal(region)` lets the servers reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import nats

from bus.contract.errors import Unreachable
from bus.local.embedded import EmbeddedNats
from bus.local.gateway_relay import GatewayRelay
from bus.local.ports import free_port
from bus.local.server_options import CLIENT_LIVENESS


class ServerAddress(msgspec.Struct, frozen=True, kw_only=True):
    """Where one server listens: clients, routes (inside its region) and gateways (between regions)."""

    region: str
    index: int  # 1-based within its region
    host: str
    client_port: int
    cluster_port: int
    gateway_port: int
    gateway_advertise: str | None = None  # host:port others should dial for its gateway (a relay), if not its own

    @property
    def name(self) -> str:
        return f"{self.region}-{self.index}"

    @property
    def gateway_url(self) -> str:
        return f"nats://{self.gateway_advertise or f'{self.host}:{self.gateway_port}'}"


class Topology(msgspec.Struct, frozen=True):
    """Every server of the supercluster, region by region."""

    servers: tuple[ServerAddress, ...]

    @property
    def regions(self) -> list[str]:
        return list(dict.fromkeys(s.region for s in self.servers))

    def of(self, region: str) -> list[ServerAddress]:
        return [s for s in self.servers if s.region == region]

    @classmethod
    def hosts(cls, regions: Sequence[str], per_region: int = 3) -> Topology:
        """The deployed layout: host `<region>-<n>`, the standard ports on every host."""
        return cls(
            tuple(
                ServerAddress(
                    region=r, index=i, host=f"{r}-{i}", client_port=4222, cluster_port=6222, gateway_port=7222
                )
                for r in regions
                for i in range(1, per_region + 1)
            )
        )


def render_config(
    topology: Topology,
    server: ServerAddress,
    *,
    store_dir: str,
    listen_host: str = "0.0.0.0",
    secure_include: str | None = None,
    fleet_dir: str = "/etc/fauxmad/fleet",
    gateways: bool = True,
) -> str:
    """One server's config. `secure_include`: the users file to include, with mutual TLS for clients (the
    deployed files); None: an open server (a loopback dev supercluster). `gateways=False`: one plain cluster
    (routes only, no gateway block), the usual HA setup of three servers."""
    # a lone server still lists a route (to itself, which nats-server skips): JetStream in a supercluster
    # refuses to start on a server whose cluster has no configured route
    peers = [s for s in topology.of(server.region) if s != server] or [server]
    routes = ", ".join(json.dumps(f"nats-route://{s.host}:{s.cluster_port}") for s in peers)
    remote_gateways = "\n".join(
        f"    {{ name: {json.dumps(region)}, urls: [{', '.join(json.dumps(s.gateway_url) for s in topology.of(region))}] }}"  # noqa: E501
        for region in topology.regions
        if region != server.region
    )
    lines = [
        f"# {server.name}: region {server.region}, server {server.index} of {len(topology.of(server.region))}",
        f'listen: "{listen_host}:{server.client_port}"',
        f"server_name: {json.dumps(server.name)}",
        f"server_tags: [{json.dumps('region:' + server.region)}]",
    ]
    if secure_include is not None:
        lines += [
            "tls {",
            f'  cert_file: "{fleet_dir}/server.pem"',
            f'  key_file: "{fleet_dir}/server-key.pem"',
            f'  ca_file: "{fleet_dir}/ca.pem"',
            "  verify: true",
            "  timeout: 2",
            "}",
        ]
    lines += [
        "jetstream {",
        f"  store_dir: {json.dumps(store_dir)}",
        # R3 inside the region: an acknowledged write is on a quorum of its servers, so a kill -9 of one loses
        # nothing; with one server per region (R1) every write is flushed before it is acknowledged instead
        "  sync_interval: always" if len(topology.of(server.region)) < 3 else "  # R3: acknowledged = on a quorum",
        "}",
        "cluster {",
        f"  name: {json.dumps(server.region)}",
        f'  listen: "{listen_host}:{server.cluster_port}"',
        f"  routes: [{routes}]",
        "}",
    ]
    if gateways:
        lines += ["gateway {", f"  name: {json.dumps(server.region)}"]
        lines.append(f'  listen: "{listen_host}:{server.gateway_port}"')
        if server.gateway_advertise:
            lines.append(f'  advertise: "{server.gateway_advertise}"')
        lines += ["  gateways: [", remote_gateways, "  ]", "}"]
    lines += [*CLIENT_LIVENESS, "max_payload: 8MB"]
    if secure_include is not None:
        lines.append(f'include "{secure_include}"')
    return "\n".join(lines) + "\n"


DEPLOY_REGIONS = ("mad", "syd", "gru")
DEPLOY_STORE = "/var/lib/fauxmad/nats"


def deploy_configs(regions: Sequence[str] = DEPLOY_REGIONS, per_region: int = 3) -> dict[str, str]:
    """The files of `deploy/nats/supercluster/`: `<region>-<n>.conf` per host, secure for clients by default
    (mutual TLS and the fleet's users, as `deploy/nats/single.conf`)."""
    topology = Topology.hosts(regions, per_region)
    return {
        f"{server.name}.conf": render_config(
            topology, server, store_dir=DEPLOY_STORE, secure_include="fleet/users.conf"
        )
        for server in topology.servers
    }


class LoopbackSupercluster:
    """`regions` x `per_region` nats-servers on 127.0.0.1: `with LoopbackSupercluster(["mad", "syd"]) as sc:`.

    `relays=True` puts a `GatewayRelay` in front of every gateway port, so `cut(region)` can partition a
    region from the others (and `heal(region)` join it again)."""

    def __init__(
        self,
        regions: Sequence[str],
        per_region: int = 3,
        *,
        root: str | Path | None = None,
        relays: bool = False,
        host: str = "127.0.0.1",
        secure_dir: str | Path | None = None,
        hosts: Sequence[tuple[str, list[str]]] = (),
        delay: float = 0.0,
    ) -> None:
        """`delay`: seconds one way on every gateway link (the relays', so `relays` must be on): WAN between regions.
        `hosts`: (address, the command a process runs under there) of each host the servers go round, in
        turn (`fauxmad dev --hosts`: network namespaces, `ip netns exec <host>`); each server then listens on
        its host's address at the standard ports (4222 clients, 6222 routes, 7222 gateways; +1 for a host's
        second server), and the relays (if any) on `host`, which must reach them all (the bridge's own address).
        `secure_dir`: a secure fleet's directory (`fauxmad fleet init`: CA, server certificate, users.conf):
        every server then requires mutual TLS and those users from clients, as the deployed files do; set
        `connect_options` (the operator's) before `start` so this object's own checks can connect."""
        self._own_root = root is None
        self.secure_dir = Path(secure_dir).absolute() if secure_dir is not None else None
        self.connect_options: dict[str, Any] = {}
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="fauxmad-sc-"))
        self.host = host
        self.relay: GatewayRelay | None = GatewayRelay(host, delay) if relays else None
        self.wraps: dict[str, list[str]] = {}  # server name -> the command it runs under (`hosts`)
        servers: list[ServerAddress] = []
        for region in regions:
            for i in range(1, per_region + 1):
                if hosts:
                    where, wrap = hosts[len(servers) % len(hosts)]
                    nth = len(servers) // len(hosts)
                    ports = (4222 + nth, 6222 + nth, 7222 + nth)
                    self.wraps[f"{region}-{i}"] = list(wrap)
                else:
                    where, ports = host, (free_port(host), free_port(host), free_port(host))
                advertise = None
                if self.relay is not None:
                    advertise = f"{host}:{self.relay.front(region, where, ports[2])}"
                servers.append(
                    ServerAddress(
                        region=region,
                        index=i,
                        host=where,
                        client_port=ports[0],
                        cluster_port=ports[1],
                        gateway_port=ports[2],
                        gateway_advertise=advertise,
                    )
                )
        self.topology = Topology(tuple(servers))
        self.servers: dict[str, EmbeddedNats] = {}
        self.gateways = True  # False: one plain cluster (`LoopbackCluster`)

    @property
    def regions(self) -> list[str]:
        return self.topology.regions

    def urls(self, region: str) -> str:
        """The client URLs of `region`'s servers, comma-separated (what `--nats` takes)."""
        scheme = "tls" if self.secure_dir is not None else "nats"
        return ",".join(f"{scheme}://{s.host}:{s.client_port}" for s in self.topology.of(region))

    def server(self, name: str) -> EmbeddedNats:
        return self.servers[name]

    def start(self, timeout: float = 20.0) -> LoopbackSupercluster:
        try:
            if self.relay is not None:
                self.relay.start()
            for address in self.topology.servers:
                directory = self.root / address.name
                directory.mkdir(parents=True, exist_ok=True)
                config = directory / "nats-server.conf"
                secure = self.secure_dir
                config.write_text(
                    render_config(
                        self.topology,
                        address,
                        store_dir=str(directory / "js"),
                        listen_host=address.host,
                        # nats-server joins an include's path to the config's directory, even an absolute one
                        secure_include=os.path.relpath(secure / "users.conf", directory) if secure else None,
                        fleet_dir=str(secure) if secure else "",
                        gateways=self.gateways,
                    )
                )
                server = EmbeddedNats(
                    port=address.client_port,
                    host=address.host,
                    wrap=self.wraps.get(address.name),
                    store_dir=directory,
                    name=address.name,
                    config_file=config,
                    tls=secure is not None,
                )
                self.servers[address.name] = server.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    async def jetstream_ready(self, timeout: float = 60.0) -> None:
        """Return once JetStream answers in every region (its meta leader elected: a few seconds after start)."""
        deadline = time.monotonic() + timeout
        for region in self.regions:
            nc = await nats.connect(self.urls(region).split(","), **self.connect_options)
            try:
                while True:
                    with contextlib.suppress(Exception):
                        reply = await nc.request("$JS.API.INFO", b"", timeout=0.5)
                        if "error" not in json.loads(reply.data):
                            break
                    if time.monotonic() > deadline:
                        raise Unreachable(f"JetStream did not answer in region {region} within {timeout:g}s")
                    await asyncio.sleep(0.1)
            finally:
                await nc.close()

    def kill(self, name: str) -> None:
        """SIGKILL one server (its store stays: `restart(name)` brings it back)."""
        self.servers[name].kill()

    def restart(self, name: str) -> None:
        self.servers[name].start()

    def cut(self, region: str) -> None:
        """Partition `region` from every other region: its gateway connections drop and stay down."""
        assert self.relay is not None, "a supercluster started without relays cannot be partitioned"
        self.relay.cut(region)

    def heal(self, region: str) -> None:
        assert self.relay is not None, "a supercluster started without relays cannot be partitioned"
        self.relay.heal(region)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        if self.relay is not None:
            self.relay.stop()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LoopbackSupercluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class LoopbackCluster(LoopbackSupercluster):
    """One NATS cluster of `size` servers on 127.0.0.1, routes between them and no gateways: the usual HA setup
    (three servers, JetStream R3), which `fauxmad dev --cluster 3` and the tests run. No layout variable is set
    for it: the fleet's layout (`bus.transport.fleet_layout`) takes its replicas from what the servers offer."""

    def __init__(
        self,
        size: int = 3,
        *,
        name: str = "fauxmad",
        root: str | Path | None = None,
        host: str = "127.0.0.1",
        secure_dir: str | Path | None = None,
        hosts: Sequence[tuple[str, list[str]]] = (),
    ) -> None:
        super().__init__([name], size, root=root, relays=False, host=host, secure_dir=secure_dir, hosts=hosts)
        self.gateways = False
        self.name = name

    @property
    def url(self) -> str:
        """Every server's client URL, comma-separated."""
        return self.urls(self.name)

    def __enter__(self) -> LoopbackCluster:
        self.start()
        return self


if __name__ == "__main__":  # python -m bus.local.supercluster DIR: (re)write the deployed configs into DIR
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "deploy/nats/supercluster")
    target.mkdir(parents=True, exist_ok=True)
    for file_name, text in deploy_configs().items():
        (target / file_name).write_text(text)
