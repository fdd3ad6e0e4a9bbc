"""A worker whose first heartbeat cannot be stored still starts, and beats once the bucket takes it.

Why: in the nemesis on hosts (seed 106 on 0811516) a worker restarted as its cluster came back from losing servers
exited with "unexpected error: NoStreamResponseError()": a JetStream publish of its start got no answer from its
stream, and nothing started it again. Here a real worker whose user may not publish to the workers bucket's subject
(its puts are never acknowledged, as with a bucket electing its leader) must come up and serve; once the server's
users are reloaded without the denial, its heartbeat is in the bucket.
"""

from __future__ import annotations

import signal
from pathlib import Path

from bus.local.embedded import EmbeddedNats
from bus.local.ports import free_port
from tests.helpers import WorkerProcess, arun, connect_nats, nats_config_denying, until, wait_until

WORKER = "first-beat-w1"


def test_a_worker_whose_first_heartbeat_is_not_stored_starts_and_beats_later(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(nats_config_denying(port, tmp_path / "js", "worker", "$KV.fauxmad_workers.>"))
    server = EmbeddedNats(port=port, config_file=config, tls=False, store_dir=tmp_path / "js").start()
    fleet_url = f"nats://fleet:fleet@127.0.0.1:{port}"
    worker = WorkerProcess(f"nats://worker:worker@127.0.0.1:{port}", "mad", WORKER, tmp_path / "worker")
    try:
        worker.start(timeout=40.0)  # it serves before its first heartbeat, which then waits for an ack that never comes
        assert worker.proc is not None
        proc = worker.proc
        wait_until(
            lambda: "the first heartbeat was not stored" in worker.log_path.read_text() or proc.poll() is not None,
            "the first heartbeat given up on, or the worker gone",
            30.0,
        )
        assert proc.poll() is None, worker.log_path.read_text()[-2000:]  # it did not exit on it

        config.write_text(nats_config_denying(port, tmp_path / "js", "worker", None))
        assert server.process is not None
        server.process.send_signal(signal.SIGHUP)

        async def stored() -> bool:
            nc = await connect_nats(fleet_url)
            try:
                kv = await nc.jetstream().key_value("fauxmad_workers")
                return bool((await kv.get(f"mad.{WORKER}")).value)
            except Exception:
                return False
            finally:
                await nc.close()

        assert arun(until(stored, "the worker's heartbeat in the bucket once it may write there", 20.0))
        worker.wait_ready(1.0)  # still running and answering
    finally:
        worker.cleanup()
        server.stop()
