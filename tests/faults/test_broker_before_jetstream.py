"""A broker whose JetStream cannot answer still answers its API subjects (orchestrator/broker/readiness.py).

Why: in the nemesis on hosts (seed 105) a broker restarted in a one-server region cut off from the others bound
its buckets before it subscribed: the region had no JetStream metadata leader, so the broker was deaf and every
create of the cut got NoResponders. Here the cheapest honest copy of that: one nats-server with JetStream, a real
worker that uses it, and a real broker whose user may not publish to `$JS.API.>` (JetStream is there, closed to
the broker, as a leaderless region's is). The broker must place an unkeyed create (an auction over core NATS) and
answer a keyed one with the contract's 503 naming the idempotency claims; once the server's config is reloaded
without the denial, both work.
"""

from __future__ import annotations

import signal
from pathlib import Path

import msgspec

from bus.local.embedded import EmbeddedNats
from bus.local.ports import free_port
from lab.bench.worker import stop_process
from tests.helpers import WorkerProcess, arun, connect_nats, nats_config_denying, spawn_broker, until

REGION = "mad"
APP = "before-js"
CONFIG = {"cmd": ["sleep", "300"], "guest": {"cpus": 1, "memory_mb": 128}}


async def _create(url: str, key: str | None) -> tuple[int, dict[str, object]]:
    nc = await connect_nats(url)
    try:
        body: dict[str, object] = {"region": REGION, "config": CONFIG}
        if key is not None:
            body["idempotency_key"] = key
        msg = await nc.request(f"fauxmad.v1.api.apps.{APP}.machines.create", msgspec.json.encode(body), timeout=10)
        code = int((msg.headers or {}).get("Nats-Service-Error-Code", 200))
        reply: dict[str, object] = msgspec.json.decode(msg.data)
        return code, reply
    finally:
        await nc.close()


def test_a_broker_answers_before_jetstream_does_and_names_what_is_not_ready(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(nats_config_denying(port, tmp_path / "js", "broker", "$JS.API.>"))
    server = EmbeddedNats(port=port, config_file=config, tls=False, store_dir=tmp_path / "js").start()
    fleet_url, broker_url = f"nats://fleet:fleet@127.0.0.1:{port}", f"nats://broker:broker@127.0.0.1:{port}"
    worker = WorkerProcess(fleet_url, REGION, "before-js-w1", tmp_path / "worker").start()
    log_path = tmp_path / "broker.log"
    broker = spawn_broker(broker_url, "before-js-b1", log_path)
    try:

        async def placed_unkeyed() -> dict[str, object]:
            try:
                code, reply = await _create(fleet_url, None)
            except Exception:  # NoRespondersError: the broker is not subscribed (yet)
                return {}
            assert code == 200, reply
            return reply

        machine = arun(until(placed_unkeyed, "an unkeyed create placed by the broker without JetStream", 20.0))
        assert machine["worker_id"] == worker.worker_id, machine

        async def listed() -> list[str]:  # the registry, from the heartbeats heard on core NATS
            nc = await connect_nats(fleet_url)
            try:
                msg = await nc.request("fauxmad.v1.api.workers.list", b"{}", timeout=5)
                return [info["worker_id"] for info in msgspec.json.decode(msg.data)]
            finally:
                await nc.close()

        assert arun(until(listed, "the worker listed live by the broker without JetStream", 10.0)) == [worker.worker_id]
        code, reply = arun(_create(fleet_url, "before-js-key-1"))
        assert code == 503, reply
        message = str(reply["error"]["message"])  # type: ignore[index]
        assert "idempotency claims" in message and "not ready" in message, message
        assert broker.poll() is None, log_path.read_text()[-2000:]

        # JetStream opens to the broker: the server's users reloaded without the denial
        config.write_text(nats_config_denying(port, tmp_path / "js", "broker", None))
        assert server.process is not None
        server.process.send_signal(signal.SIGHUP)

        async def placed_keyed() -> dict[str, object]:
            code, reply = await _create(fleet_url, "before-js-key-1")
            return reply if code == 200 else {}

        keyed = arun(until(placed_keyed, "the keyed create placed once JetStream answers", 30.0))
        code, again = arun(_create(fleet_url, "before-js-key-1"))
        assert code == 200 and again["id"] == keyed["id"], again  # the key's one machine
        code, unkeyed = arun(_create(fleet_url, None))
        assert code == 200 and unkeyed["id"] not in (machine["id"], keyed["id"]), unkeyed
        assert "not ready" in log_path.read_text(), log_path.read_text()[-2000:]
    finally:
        stop_process(broker)
        worker.cleanup()
        server.stop()
