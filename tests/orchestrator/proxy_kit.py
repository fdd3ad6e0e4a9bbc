"""Plumbing for the edge proxy's tests: a real `fauxmad proxy` process, apps published to KV, a raw client.

The client speaks HTTP/1.1 over asyncio streams (no library), so a test sees exactly the bytes the proxy
sent: status, headers, body, and whether the connection stayed open.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Machine
from bus.local.ports import free_port
from bus.transport.connection import connect
from bus.transport.jetstream import ensure_fleet_resources
from lab.bench.http_client import Client, Response
from orchestrator.apps.releases import Releases
from orchestrator.apps.spec import PRIMARY, SPARE, AppSpec, parse_spec
from orchestrator.apps.store import KVReleaseStore
from orchestrator.client import FleetClient
from orchestrator.proxy.upstream import connect_when_up
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
ECHO = ROOT / "examples" / "echo" / "app.py"


class ProxyProcess:
    def __init__(self, nats_url: str, region: str, log_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.admin = free_port()
        self.log_path = log_dir / f"proxy-{self.port}.log"
        args = [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "proxy",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--admin",
            f"127.0.0.1:{self.admin}",
            "--region",
            region,
            "--nats",
            nats_url,
            *extra,
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env, cwd=str(ROOT))

        def listening() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log_path.read_text()[-3000:]}")
            return b"listening on" in self.log_path.read_bytes()

        wait_until(listening, "the proxy listening", timeout=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def alive(self) -> bool:
        return self.proc.poll() is None


def spec_for(app: str, regions: dict[str, int], http_service: str = "") -> AppSpec:
    region_lines = "\n".join(f"{r} = {n}" for r, n in regions.items())
    text = (
        f'app = "{app}"\ncmd = ["python3", "{ECHO}"]\n[guest]\nmemory_mb = 64\n'
        f"[regions]\n{region_lines}\n[http_service]\n{http_service}\n"
    )
    return parse_spec(text)


async def publish(nats_url: str, spec: AppSpec) -> int:
    """Make `spec` the app's current release (as a deploy would, without converging anything)."""
    nc = await connect(nats_url, "proxy-test")
    try:
        kv = await ensure_fleet_resources(nc.jetstream())
        releases = Releases(KVReleaseStore(kv.apps))
        release = await releases.create(spec, "proxy test")
        await releases.point(spec.app, release.version)
        return release.version
    finally:
        await nc.close()


async def machines(nats_url: str, spec: AppSpec, release: int, placed: list[tuple[str, bool]]) -> list[Machine]:
    """Create the app's machines: (region, started?) each; stopped ones are spares (never started)."""
    client = await FleetClient.connect(nats_url)
    try:
        out = []
        for region, started in placed:
            config = spec.machine_config(release, PRIMARY if started else SPARE)
            out.append(
                await client.create(spec.app, CreateRequest(region=region, config=config, skip_launch=not started))
            )
        for machine in out:  # started means launched: wait until each process has bound its port
            if machine.state == "started" and machine.port is not None:
                conn = await connect_when_up(("127.0.0.1", machine.port), 10.0)
                assert conn is not None, f"{machine.id} never listened on {machine.port}"
                conn.close()
        return out
    finally:
        await client.close()


async def get(port: int, host: str, path: str = "/", **options: Any) -> Response:
    client = Client(port)
    try:
        return await client.request(host, path, **options)
    finally:
        await client.close()
