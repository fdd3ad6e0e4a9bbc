"""`bus.transport.jsfast` on a secure fleet: a JetStream request whose publish nats-server refuses fails at once
with a 403 naming the subject (`Forbidden`), not with the timeout's `Unreachable` (what it did before: the server
drops a refused message, so nothing ever answered). The fast path's timeout here is far longer than the test
runs, so the error's type and words are the evidence: only the server's refusal gives a `Forbidden`, only the
timer an "within 60s". A real nats-server with the fleet's permissions (`FleetDir`), a viewer's credentials."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from bus.contract.errors import Forbidden
from bus.local.embedded import find_binary
from bus.local.ports import free_port
from bus.transport.connection import connect
from bus.transport.jsfast import FastJetStream, FastKV
from orchestrator.security.fleetdir import FleetDir
from tests.helpers import arun
from tests.orchestrator.security.test_security_matrix import _wait_listening

TIMEOUT = 60.0  # the fast path's own: a refusal must not wait for it


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetDir, str]]:
    root = tmp_path_factory.mktemp("jsfast-secure")
    port = free_port()
    fleet = FleetDir(root / "fleet")
    fleet.init(port=port)
    fleet.add_user("ops-bob", "viewer")
    server = subprocess.Popen(
        [find_binary(), "-c", str(fleet.config), "-l", str(root / "nats.log")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, server, root / "nats.log")
        yield fleet, f"tls://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_refused_publish_is_a_403_naming_the_subject_at_once(fleet: tuple[FleetDir, str]) -> None:
    directory, url = fleet

    async def main() -> tuple[list[str], bytes | None]:
        operator = await connect(url, "jsfast-operator", creds=str(directory.creds("operator")))
        viewer = await connect(url, "jsfast-viewer", creds=str(directory.creds("ops-bob")))
        said: list[str] = []
        try:
            # a bucket of the fleet's (the viewer may read it) and one of nobody's, both real
            jobs = await operator.jetstream().create_key_value(bucket="fauxmad_jobs", history=1)
            await jobs.put("web.j1", b"queued")
            await operator.jetstream().create_key_value(bucket="jsfast_private", history=1)
            js = await FastJetStream(viewer, timeout=TIMEOUT).start()
            for attempt in (
                FastKV(js, "fauxmad_jobs").update("web.j1", b"forged", 0),  # a write: the viewer only reads
                FastKV(js, "jsfast_private").get("k"),  # a read of a stream no role lists
                js.publish("$KV.fauxmad_jobs.web.j2", b"forged"),
            ):
                with pytest.raises(Forbidden) as refused:
                    await attempt
                said.append(refused.value.message)
            got = await FastKV(js, "fauxmad_jobs").get("web.j1")  # the connection still serves what it may
            return said, None if got is None else got[0]
        finally:
            await viewer.close()
            await operator.close()

    said, still = arun(main())
    assert said == [
        "identity ops-bob may not publish to $KV.fauxmad_jobs.web.j1: not allowed by its permissions"
        " (nats-server refused it)",
        "identity ops-bob may not publish to $JS.API.STREAM.MSG.GET.KV_jsfast_private: not allowed by its"
        " permissions (nats-server refused it)",
        "identity ops-bob may not publish to $KV.fauxmad_jobs.web.j2: not allowed by its permissions"
        " (nats-server refused it)",
    ]
    assert still == b"queued"
