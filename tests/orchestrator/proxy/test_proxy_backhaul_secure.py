"""On a secure fleet the backhaul is mutual TLS with the fleet's CA: the edge (with the operator's credentials
here) reaches a machine on "another host" (a worker advertising 127.0.0.2), and a client without a certificate
from the fleet's CA never gets to the preamble: neither in plain TCP nor in TLS without a client certificate."""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bus.contract.backhaul import request_line
from bus.contract.fleet import WorkerInfo
from bus.transport.credentials import CREDS_ENV
from lab.bench.http_client import Client
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun
from tests.orchestrator import proxy_kit as kit
from tests.orchestrator.proxy.test_proxy_backhaul import OTHER_HOST, make_app, workers


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    spec = FleetSpec(
        regions=["bhs"], workers_per_region=1, cpus=4, memory_mb=2048, secure=True, advertise={"bhs": OTHER_HOST}
    )
    before = os.environ.get(CREDS_ENV)
    with DevFleet(spec) as running:
        assert running.operator_creds is not None
        os.environ[CREDS_ENV] = running.operator_creds  # this test, and the edge it starts, act as the operator
        try:
            yield running
        finally:
            if before is None:
                os.environ.pop(CREDS_ENV, None)
            else:
                os.environ[CREDS_ENV] = before


def test_the_edge_reaches_another_host_over_mutual_tls(
    fleet: DevFleet, tmp_path_factory: pytest.TempPathFactory, unique: Callable[[str], str]
) -> None:
    name = unique("tls")
    (machine,) = make_app(fleet, name, [("bhs", "bhs-w1")])
    proxy = kit.ProxyProcess(fleet.url, "bhs", tmp_path_factory.mktemp("proxy"))
    try:

        async def main() -> list[int]:
            client = Client(proxy.port)
            try:
                return [(await client.request(f"{name}.localhost")).status for _ in range(3)]
            finally:
                await client.close()

        assert arun(main()) == [200, 200, 200]
    finally:
        proxy.stop()
    assert machine.address == OTHER_HOST


def test_the_backhaul_refuses_a_client_without_a_fleet_certificate(fleet: DevFleet) -> None:
    (worker,) = workers(fleet, "bhs")
    assert fleet.security is not None

    async def plain(info: WorkerInfo) -> bytes:
        reader, writer = await asyncio.open_connection(info.address, info.backhaul)
        try:
            writer.write(request_line("0" * 14, 80))
            return await asyncio.wait_for(reader.read(100), 10)
        except (ConnectionError, OSError):
            return b""
        finally:
            writer.close()

    async def tls_without_certificate(info: WorkerInfo, ca: Path) -> bytes:
        context = ssl.create_default_context(cafile=str(ca))
        context.check_hostname = False
        try:
            reader, writer = await asyncio.open_connection(info.address, info.backhaul, ssl=context)
            writer.write(request_line("0" * 14, 80))
            return await asyncio.wait_for(reader.read(100), 10)
        except (ConnectionError, OSError, ssl.SSLError):
            return b""

    assert arun(plain(worker)) == b""  # a TLS server reads no preamble in clear: no answer, the connection ends
    assert arun(tls_without_certificate(worker, fleet.security.root / "ca.pem")) == b""


def test_only_the_edges_and_the_operators_certificates_open_a_machine(
    fleet: DevFleet, unique: Callable[[str], str]
) -> None:
    """Every identity's certificate comes from the fleet's CA, so the CA alone would let a deployer of one app reach
    any app's machines through a backhaul. The worker reads the role its certificate names: proxy and operator
    may; a deployer (even of the machine's own app) and a broker are refused in one line naming the role."""
    assert fleet.security is not None
    name = unique("roles")
    (machine,) = make_app(fleet, name, [("bhs", "bhs-w1")])
    assert machine.port is not None
    (worker,) = workers(fleet, "bhs")
    fleet.security.add_user(f"dep-{name}", "deployer", app=name)
    root = fleet.security.root

    async def answer(identity: str) -> bytes:
        context = ssl.create_default_context(cafile=str(root / "ca.pem"))
        context.check_hostname = False
        context.load_cert_chain(str(root / "creds" / f"{identity}.pem"), str(root / "creds" / f"{identity}-key.pem"))
        reader, writer = await asyncio.open_connection(worker.address, worker.backhaul, ssl=context)
        try:
            writer.write(request_line(machine.id, machine.port or 0))
            return await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()

    assert arun(answer("proxy-1")) == b"ok\n"
    assert arun(answer("operator")) == b"ok\n"
    refused = arun(answer(f"dep-{name}"))
    assert refused.startswith(b"error ") and b"role deployer" in refused, refused
    assert arun(answer("broker-1")).startswith(b"error "), "a broker has no business with machines' bytes"
