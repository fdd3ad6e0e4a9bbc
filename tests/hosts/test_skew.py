"""A host whose clock is off (issue 40): one worker of two runs under libfaketime, +3 s ahead or 30 s behind.

What the fleet tolerates is `MAX_CLOCK_SKEW` (0.25 s, docs/explanation/faults.md "Skewed clocks"). Past it:
the skewed worker still beats (the registry's expiry is the server's clock) and keeps what runs on it, says its
skew in its heartbeat, and refuses every reserve with one line naming the skew, so every create lands on the
worker whose clock is right and none fails. A worker's reserve deadline is the broker's clock, read on the
worker's: +3 s would refuse every reserve as expired without saying why, -30 s would commit one long after the
broker gave it up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest

from bus.contract import subjects
from bus.contract.codec import encode
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig, ReserveRequest
from bus.transport.jetstream import MAX_CLOCK_SKEW
from orchestrator.client import FleetClient
from orchestrator.devfleet import FAKETIME_LIBRARY, DevFleet, FleetSpec
from orchestrator.devhosts import unavailable
from tests.helpers import ROOT, arun, connect_nats, wait_until

REASON = unavailable() or (None if os.path.exists(FAKETIME_LIBRARY) else "libfaketime (Debian's faketime) missing")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs hosts and libfaketime: {REASON}")

REGION = "skw"
SKEWED, RIGHT = "skw-w1", "skw-w2"
CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=64))


@pytest.fixture(scope="module", params=["+3s", "-30s"])
def fleet(request: pytest.FixtureRequest) -> Iterator[tuple[DevFleet, float]]:
    offset = str(request.param)
    spec = FleetSpec(regions=[REGION], workers_per_region=2, hosts=3, cpus=8, memory_mb=2048, skew={SKEWED: offset})
    with DevFleet(spec) as running:
        yield running, float(offset.rstrip("s"))


def workers(fleet: DevFleet) -> dict[str, dict[str, object]]:
    env = dict(os.environ, FAUXMAD_NATS_URL=fleet.url, PYTHONPATH=str(ROOT))
    shown = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "workers", "--json"], capture_output=True, text=True, env=env
    )
    assert shown.returncode == 0, shown.stderr
    return {str(w["worker_id"]): w for w in json.loads(shown.stdout)}


def test_the_skewed_worker_beats_and_its_heartbeat_says_its_skew(fleet: tuple[DevFleet, float]) -> None:
    running, offset = fleet

    def measured() -> dict[str, dict[str, object]] | None:
        listed = workers(running)
        return listed if abs(float(str(listed[SKEWED]["clock_skew"])) - offset) < 1.0 else None

    listed = wait_until(measured, f"{SKEWED}'s heartbeat saying its clock is {offset:+g} s off", 15, 0.5)
    assert abs(float(str(listed[RIGHT]["clock_skew"]))) < MAX_CLOCK_SKEW, listed[RIGHT]


def test_every_create_lands_on_the_worker_whose_clock_is_right(fleet: tuple[DevFleet, float]) -> None:
    running, _ = fleet

    async def run() -> list[str]:
        client = await FleetClient.connect(running.url)
        try:
            made = [
                await client.create("clocks", CreateRequest(region=REGION, config=CONFIG, skip_launch=True))
                for _ in range(6)
            ]
            return [m.worker_id for m in made]
        finally:
            await client.close()

    assert arun(run()) == [RIGHT] * 6


def test_a_reserve_on_the_skewed_worker_is_refused_in_one_line_naming_the_skew(fleet: tuple[DevFleet, float]) -> None:
    running, offset = fleet

    async def run() -> tuple[dict[str, str], bytes]:
        nc = await connect_nats(running.url)
        try:
            reserve = ReserveRequest(app="clocks", region=REGION, config=CONFIG, id="0123456789abcd")
            reply = await nc.request(subjects.worker_machines(SKEWED, "reserve"), encode(reserve), timeout=5)
            return dict(reply.headers or {}), reply.data
        finally:
            await nc.close()

    headers, body = arun(run())
    message = msgspec.json.decode(body)["error"]["message"]
    way = "ahead of" if offset > 0 else "behind"
    assert f"clock is {abs(offset):.0f}" in message and way in message and "\n" not in message, message
    assert headers.get("Nats-Service-Error-Code") == "503", headers
