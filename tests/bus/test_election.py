"""A JetStream read waits through a meta-leader election (its 503s) and says so in words when none ends in time; the
release store's reads wait so on a real cluster that lost its quorum and gets it back; the command line says a 503 it
still gets in one line."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import BadRequestError, ServiceUnavailableError

from bus.contract.errors import Unreachable
from bus.local.supercluster import LoopbackCluster
from bus.transport import election
from orchestrator.apps.store import KVReleaseStore
from orchestrator.cli.app import report
from tests.helpers import arun, until


def test_a_read_answered_503_is_made_again_until_the_leader_is_elected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(election, "RETRY_EVERY", 0.0)
    answers: list[object] = [ServiceUnavailableError(), ServiceUnavailableError(), "the keys"]
    asked = []

    async def ask() -> object:
        asked.append(1)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert arun(election.through_election(ask, "the keys of KV_fauxmad_apps")) == "the keys"
    assert len(asked) == 3


def test_no_leader_within_the_wait_is_unreachable_in_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(election, "RETRY_EVERY", 0.0)
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0  # every look at the clock: one second later
        return now[0]

    async def ask() -> object:
        raise ServiceUnavailableError()

    with pytest.raises(Unreachable, match="the keys of KV_fauxmad_apps: JetStream has had no leader for 5s"):
        arun(election.through_election(ask, "the keys of KV_fauxmad_apps", within=5.0, clock=clock))


def test_other_errors_are_not_waited_for() -> None:
    async def ask() -> object:
        raise ValueError("not an election")

    with pytest.raises(ValueError):
        arun(election.through_election(ask, "anything"))


def test_the_command_line_says_a_503_in_one_line_with_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    assert report(ServiceUnavailableError()) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "JetStream is unavailable" in err and "Traceback" not in err, err


async def _bucket(nc: Any) -> Any:
    try:
        return await nc.jetstream().create_key_value(bucket="election", replicas=3)
    except BadRequestError:
        return None


async def _answers_503(nc: Any, subject: str, body: bytes) -> bool:
    try:
        answer = await nc.request(subject, body, timeout=0.5)
    except Exception:  # a timeout or no responders: not the 503 looked for
        return False
    return bool(json.loads(answer.data).get("error", {}).get("code") == 503)


@pytest.mark.fleet  # a real three-server cluster
def test_a_release_read_waits_while_the_cluster_has_no_leader_and_reads_once_it_has(tmp_path: Path) -> None:
    """Two of three servers killed: after its lost-quorum interval the last one answers the API 503 (a plain
    nats-py read fails at once, as a deploy's read of its release did in CI65). The release store's read made then
    waits, a killed server is restarted 1 s later, and the read returns the value once a leader is elected."""
    get = ("$JS.API.STREAM.MSG.GET.KV_election", json.dumps({"last_by_subj": "$KV.election.web.head"}).encode())
    with LoopbackCluster(3, root=tmp_path / "nats") as cluster:
        arun(cluster.jetstream_ready())
        names, urls = list(cluster.servers), cluster.url.split(",")

        async def main() -> None:
            setup = await nats.connect(urls)
            # an R3 bucket needs all three servers current with the meta leader: "no suitable peers" until then
            kv = await until(lambda: _bucket(setup), "an R3 bucket made", timeout=30)
            await kv.put("web.head", b"v1")
            await setup.close()
            nc = await nats.connect([urls[0]], allow_reconnect=False)
            # the bucket's handle while the cluster has a leader: nats-py makes it with a stream info, which
            # is answered 503 too once there is none (CI76)
            bucket = await nc.jetstream().key_value("election")
            for name in names[1:]:
                cluster.kill(name)
            try:
                await until(lambda: _answers_503(nc, *get), "the last server to answer the API 503", timeout=30)
                with pytest.raises(ServiceUnavailableError):  # a plain read: at once
                    await bucket.get("web.head")
                # on this thread: a server started from another one dies with it (its parent-death signal)
                asyncio.get_running_loop().call_later(1.0, cluster.restart, names[1])
                began = time.perf_counter()
                assert await KVReleaseStore(bucket).get("web.head") == b"v1"
                assert time.perf_counter() - began >= 1.0, "the read was answered before any server came back"
            finally:
                await nc.close()

        arun(main())
