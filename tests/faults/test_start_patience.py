"""An agent started while JetStream cannot answer waits for it instead of exiting
(`bus.transport.jetstream.ensure_fleet_resources_patiently`): a worker comes up against a nats-server without
JetStream, which is then replaced on the same port by one with it (the moment a cluster starts with the fleet,
or elects its streams' leaders, looks the same from a worker: no answer for a few seconds)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from bus.local.embedded import EmbeddedNats
from bus.local.ports import free_port
from tests.helpers import WorkerProcess


@pytest.mark.fleet  # starts processes of its own
def test_a_worker_started_before_jetstream_answers_waits_and_then_runs(tmp_path: Path) -> None:
    port = free_port()
    plain = tmp_path / "no-jetstream.conf"
    plain.write_text("# a nats-server without JetStream\n")
    without = EmbeddedNats(port=port, config_file=plain, tls=False, store_dir=tmp_path / "plain").start()
    worker = WorkerProcess(without.url, "mad", "patient-w1", tmp_path / "worker")
    swapped = threading.Event()

    def swap() -> None:
        time.sleep(2.0)  # the worker has connected and found no JetStream by now
        without.kill()
        swapped.set()

    server: EmbeddedNats | None = None
    thread = threading.Thread(target=swap)
    thread.start()
    try:
        starting = threading.Thread(target=lambda: worker.start(timeout=40.0))
        starting.start()
        assert swapped.wait(10)
        server = EmbeddedNats(port=port, store_dir=tmp_path / "js").start()
        starting.join(45)
        assert not starting.is_alive()
        worker.wait_ready(1.0)  # raises, with the worker's log, if it exited or never became ready
        log = worker.log_path.read_text()
        assert "asking again for up to 30s" in log, log[-2000:]
    finally:
        thread.join()
        worker.cleanup()
        without.stop()
        if server is not None:
            server.stop()
