"""An edge proxy's refused connection starts the spare: the proxy signals, the reconciler probes the
worker, finds it silent and fails over, without waiting for the worker's heartbeat to expire.

Real parts: a dev fleet (NATS, two workers, a broker), an app deployed by `fauxmad deploy` (a primary and
its spare on the other worker), a `fauxmad reconcile --watch` operator, a `fauxmad proxy`, and a host
killed with SIGKILL (its worker and its machines). The proxy's own autostart is off (`auto_start =
false`), so the spare can only have been started by the reconciler.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import msgspec

from bus.contract.edge import ProxyUnreachable
from bus.contract.machines import Machine
from bus.transport.jetstream import WORKER_TTL
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests import helpers
from tests.helpers import arun, connect_nats, fleet_fixture, start_operator
from tests.orchestrator import proxy_kit as kit

APP = "edgeha"


fleet = fleet_fixture(FleetSpec(regions=["pfo"], workers_per_region=2, cpus=8, memory_mb=4096))


def fauxmad(fleet: DevFleet, *args: str) -> subprocess.CompletedProcess[str]:
    return helpers.fauxmad(*args, url=fleet.url)


def machines(fleet: DevFleet) -> list[Machine]:
    async def main() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return await client.list(APP)
        finally:
            await client.close()

    return arun(main())


def role(machine: Machine) -> str:
    return machine.config.metadata.get("fauxmad_role", "")


def test_a_refused_connection_starts_the_spare_before_the_heartbeat_expires(fleet: DevFleet, tmp_path: Path) -> None:
    spec = tmp_path / "fauxmad.toml"
    spec.write_text(
        f'app = "{APP}"\ncmd = ["python3", "{kit.ECHO}"]\n[guest]\nmemory_mb = 64\n[regions]\npfo = 1\n'
        '[deploy]\nspares = 1\nwait_timeout = "10s"\n[http_service]\nauto_start = false\n'
    )
    deployed = fauxmad(fleet, "deploy", "-c", str(spec))
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    found = machines(fleet)
    (primary,) = [m for m in found if role(m) == "primary"]
    (spare,) = [m for m in found if role(m) == "spare"]
    assert primary.state == "started" and spare.state != "started" and spare.worker_id != primary.worker_id

    log = tmp_path / "operator.log"
    operator = start_operator(fleet.url, log, APP)
    proxy = kit.ProxyProcess(fleet.url, "pfo", tmp_path)
    try:

        async def main() -> tuple[float, float, list[ProxyUnreachable], list[int]]:
            nc = await connect_nats(fleet.url)
            heard: list[tuple[float, ProxyUnreachable]] = []

            async def on_signal(msg: object) -> None:
                heard.append((time.perf_counter(), msgspec.json.decode(msg.data, type=ProxyUnreachable)))  # type: ignore[attr-defined]

            await nc.subscribe(f"fauxmad.v1.proxy.unreachable.{APP}.>", cb=on_signal)
            client = kit.Client(proxy.port)
            before = await client.request(f"{APP}.localhost")
            assert (before.status, before.json()["machine"]) == (200, primary.id)
            fleet.kill_host(primary.worker_id)
            killed = time.perf_counter()
            statuses: list[int] = []
            started_at = None

            async def requests() -> None:  # through the proxy: the first one meets the refused connection
                while started_at is None:
                    fresh = kit.Client(proxy.port)
                    statuses.append((await fresh.request(f"{APP}.localhost")).status)
                    await fresh.close()

            load = asyncio.create_task(requests())
            fleet_client = await FleetClient.connect(fleet.url)
            try:
                while time.perf_counter() - killed < 4 * WORKER_TTL:
                    now = await fleet_client.get(APP, spare.id, events=False)
                    if now.state == "started":
                        started_at = time.perf_counter()
                        break
                    await asyncio.sleep(0.01)
                await asyncio.wait_for(load, 15)
            finally:
                load.cancel()
                await fleet_client.close()
                await client.close()
                await nc.close()
            assert heard, "the proxy signalled the refused connection"
            assert started_at is not None, "the spare was started"
            return heard[0][0] - killed, started_at - heard[0][0], [s for _, s in heard], statuses

        to_signal, to_spare, signals, statuses = arun(main())
        print(f"\nhost killed -> signal {to_signal * 1000:.0f} ms; signal -> spare started {to_spare * 1000:.0f} ms")
        # autostart is off: until the spare is started the proxy says so (502), it never hangs
        assert statuses and set(statuses) <= {200, 502}, statuses
        assert signals[0].machine_id == primary.id and signals[0].worker_id == primary.worker_id
        assert "is silent after proxy pfo could not reach" in log.read_text()
        promoted = next(m for m in machines(fleet) if m.id == spare.id)
        assert role(promoted) == "primary" and promoted.config.metadata["fauxmad_replaces"] == primary.id
        served = arun(kit.get(proxy.port, f"{APP}.localhost"))
        assert (served.status, served.json()["machine"]) == (200, spare.id)
    finally:
        proxy.stop()
        operator.send_signal(signal.SIGINT)
        code = operator.wait(20)
    assert code == 0, log.read_text()
