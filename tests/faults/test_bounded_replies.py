"""One request must never cut a process off the bus: replies stay small, and a closed connection is fatal.

msgspec's validation messages echo the offending value. Before the fix the error edge copied a 600 KB
value into the `Nats-Service-Error` header; the reply went over the server's max_payload, nats-server
closed the connection, and nats-py, which does not reconnect after a server `-ERR`, left the worker or
broker running deaf.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from bus.local.embedded import EmbeddedNats
from bus.transport.connection import connect
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture, until

HUGE = "A" * 600_000


fleet = fleet_fixture(FleetSpec(regions=["b"], workers_per_region=1, brokers=1))


async def ask(nc: nats.NATS, subject: str, payload: bytes) -> tuple[int, int, str]:
    msg = await nc.request(subject, payload, timeout=3)
    headers = msg.headers or {}
    return int(headers.get("Nats-Service-Error-Code", 200)), len(msg.data), headers.get("Nats-Service-Error", "")


@pytest.mark.parametrize(
    "subject_of, payload",
    [
        (lambda w: f"fauxmad.v1.worker.{w}.machines.wait", {"id": "0" * 14, "state": HUGE}),
        (lambda w: "fauxmad.v1.api.apps.big.machines.list", {"state": HUGE}),
        (lambda w: "fauxmad.v1.api.apps.big.machines.create", {"region": HUGE, "config": {"cmd": ["true"]}}),
        (
            lambda w: f"fauxmad.v1.worker.{w}.machines.reserve",
            {"app": "big", "region": "b", "name": HUGE, "config": {"cmd": ["true"]}},
        ),
    ],
)
def test_a_huge_bad_value_gets_a_small_400_and_everyone_keeps_answering(fleet: DevFleet, subject_of, payload) -> None:
    worker_id = fleet.worker_ids[0]

    async def main() -> None:
        nc = await connect_nats(fleet.url)
        try:
            for _ in range(3):
                code, size, header = await ask(nc, subject_of(worker_id), msgspec.json.encode(payload))
                assert code == 400
                assert size < 2048 and len(header) < 1024, (size, len(header))
            # the worker and the broker are still on the bus
            info = msgspec.json.decode((await nc.request(f"fauxmad.v1.worker.{worker_id}.info", b"", timeout=2)).data)
            assert info["worker_id"] == worker_id
            kv = await nc.jetstream().key_value("fauxmad_workers")
            before = (await kv.get(f"b.{worker_id}")).revision

            async def beat_again() -> bool:
                return bool((await kv.get(f"b.{worker_id}")).revision > before)

            await until(beat_again, "the worker's next heartbeat (still beating)", 10)
            listed = msgspec.json.decode((await nc.request("fauxmad.v1.api.workers.list", b"", timeout=2)).data)
            assert [w["worker_id"] for w in listed] == [worker_id]
        finally:
            await nc.close()

    arun(main())


@pytest.mark.fleet  # starts processes of its own
def test_a_connection_the_server_closes_is_reported_to_the_agent() -> None:
    """nats-py closes for good on a server -ERR; an agent's `on_closed` hears of it (it then exits non-zero)."""
    reasons: list[str] = []

    async def main() -> None:
        with EmbeddedNats(name="fauxmad-closed") as server:
            nc = await connect(server.url, "agent", agent=True, on_closed=reasons.append)
            # a control line over the server's 4 KiB limit: the server says -ERR and closes (an oversized publish
            # raced: the server's close could fail the client's write first, and nats-py reconnected)
            await nc.subscribe("x" * 5000)
            for _ in range(100):
                if reasons:
                    break
                await asyncio.sleep(0.05)
            assert nc.is_closed

    arun(main())
    assert reasons and "closed" in reasons[0]
