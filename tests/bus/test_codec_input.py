"""Hostile bytes at the decoding edge: every one is a short 400 (`BadRequest`), never a 500.

Unit tests of the pure codec, then the same payloads sent raw over a real nats-server to a real worker
process and a real broker process, reading the contract's error header as another service would.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import nats
import pytest

from bus.contract import subjects
from bus.contract.codec import decode, decode_any
from bus.contract.errors import BadRequest
from bus.contract.fleet import WorkersListRequest
from bus.contract.machines import GetRequest, Machine, MachineIndexEntry, ReserveRequest
from bus.transport.service import ERROR_CODE_HEADER, ERROR_HEADER
from lab.bench.worker import stop_process
from tests.helpers import ROOT, WorkerProcess, arun

BAD_UTF8 = [
    b'{"id": "\xff\xfe"}',  # not UTF-8 at all
    b'{"id": "\xed\xa0\x80"}',  # an encoded surrogate (CESU-8), which UTF-8 forbids
    b'{"id": "\xc0\xaf"}',  # an overlong encoding of '/'
    b'{"id": "\xf4\x90\x80\x80"}',  # beyond U+10FFFF
    b'{"id": "abc\xe2\x82"}',  # truncated sequence
    b'{"\xff": 1}',  # in a key
    b'{"id": "0123456789abcd", "events": true, "x": "\xff"}',  # in a field msgspec would skip
]
LONE_SURROGATES = [b'{"id": "\\ud800"}', b'{"id": "\\udc00"}', b'{"id": "\\ud800x"}', b'{"id": "\\ud800\\u0041"}']


@pytest.mark.parametrize("data", BAD_UTF8 + LONE_SURROGATES)
def test_invalid_text_is_a_bad_request(data: bytes) -> None:
    with pytest.raises(BadRequest, match="malformed JSON") as caught:
        decode(GetRequest, data)
    assert caught.value.code == 400
    with pytest.raises(BadRequest, match="malformed JSON"):
        decode_any(GetRequest | None, data)


def test_invalid_utf8_names_the_byte() -> None:
    with pytest.raises(BadRequest, match=r"^malformed JSON: invalid UTF-8 \(byte 8\)$"):
        decode(GetRequest, b'{"id": "\xff\xfe"}')
    with pytest.raises(BadRequest, match=r"invalid UTF-8 \(byte 12\)"):
        decode(WorkersListRequest, b'{"region": "\xed\xa0\x80"}')


def test_valid_utf8_and_escaped_pairs_still_decode() -> None:
    assert decode(WorkersListRequest, b'{"region": null}').region is None
    entry = decode(
        MachineIndexEntry,
        '{"id": "a", "worker_id": "w", "region": "r", "app": "x", "state": "started",'
        ' "name": "caf\u00e9 \\ud83d\\ude00 \U0001f600"}'.encode(),
    )
    assert entry.name == "caf\u00e9 \U0001f600 \U0001f600"
    entry.name.encode()  # a real pair, never a lone surrogate
    assert decode(WorkersListRequest, b"", empty_ok=True).region is None


def test_deep_nesting_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="nested too deeply"):
        decode_any(Any, b"[" * 100_000 + b"]" * 100_000)
    deep = (
        b'{"id":"x","name":"n","app":"a","region":"r","worker_id":"w","state":"started","config":{},'
        b'"instance_id":"i","created_at":"","updated_at":"","explain":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    with pytest.raises(BadRequest, match="nested too deeply"):
        decode(Machine, deep)


def test_messages_never_echo_huge_input() -> None:
    huge = "z" * 100_000
    cases = [
        (ReserveRequest, f'{{"app":"a","region":"r","config":{{"cmd":["x"],"restart":{{"policy":"{huge}"}}}}}}'),
        (GetRequest, f'{{"id":"0123456789abcd","{huge}":1}}'),
        (GetRequest, f'{{"id":"{huge}"}}'),
    ]
    for kind, text in cases:
        with pytest.raises(BadRequest) as caught:
            decode(kind, text.encode())
        assert len(caught.value.message) <= 300, caught.value.message[:400]
        if kind is ReserveRequest:  # the field is still named
            assert caught.value.message.endswith("- at `$.config.restart.policy`"), caught.value.message
    with pytest.raises(BadRequest) as caught:
        subjects.check_token("app", huge)
    assert len(caught.value.message) <= 300
    assert caught.value.message.startswith("invalid app 'zzz") and caught.value.message.endswith(
        ": use 1-64 letters, digits, '-' or '_'"
    )


# ---------------------------------------------------------------------------------------------------
# the same payloads over a real nats-server, to a real worker process and a real broker process


@pytest.fixture
def broker(nats_url: str, tmp_path: Any) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path / "broker.log").open("ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "broker",
            "--nats",
            nats_url,
            "--name",
            f"codec-{time.monotonic_ns()}",
        ],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    log.close()
    try:
        yield proc
    finally:
        stop_process(proc)


async def _raw(nc: Any, subject: str, data: bytes) -> tuple[str, str, Any]:
    msg = await nc.request(subject, data, timeout=5)
    headers = msg.headers or {}
    return headers.get(ERROR_CODE_HEADER, "200"), headers.get(ERROR_HEADER, ""), msgspec.json.decode(msg.data)


def test_bad_text_over_the_bus_is_a_400_from_worker_and_broker(
    nats_url: str,
    worker_factory: Callable[..., WorkerProcess],
    broker: subprocess.Popen[bytes],
    unique: Callable[[str], str],
) -> None:
    worker = worker_factory()
    app = unique("codec")

    async def main() -> None:
        nc = await nats.connect(nats_url)
        try:
            mine = b'{"region": "%s"}' % worker.region.encode()
            deadline = time.monotonic() + 20
            while True:  # the broker is ready once it knows the worker
                try:
                    if (await _raw(nc, subjects.API_WORKERS_LIST, mine))[2]:
                        break
                except Exception:
                    pass
                assert broker.poll() is None and time.monotonic() < deadline, "broker did not come up"
                await asyncio.sleep(0.1)
            targets = [subjects.worker_machines(worker.worker_id, verb) for verb in ("get", "stop", "destroy", "wait")]
            targets.append(subjects.api_machines(app, "get"))
            for subject in targets:
                for data in (b'{"id": "\xff\xfe"}', b'{"id": "\\ud800"}', b'{"id": "\xed\xa0\x80"}'):
                    code, message, body = await _raw(nc, subject, data)
                    assert code == "400", (subject, data, code, message)
                    assert body["error"]["code"] == 400 and message.startswith("malformed JSON")
            for data in (b'{"region": "\xed\xa0\x80"}', b'{"region": "\\udfff"}', b'{"region": "\xff"}'):
                code, message, _ = await _raw(nc, subjects.API_WORKERS_LIST, data)
                assert code == "400", (data, code, message)
            # and both still answer good requests afterwards
            code, _, listed = await _raw(nc, subjects.API_WORKERS_LIST, mine)
            assert code == "200" and [w["worker_id"] for w in listed] == [worker.worker_id]
        finally:
            await nc.close()

    arun(main())
    # a 400 from the broker that reaches the CLI is bad input there too: exit 2, one line
    shown = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "machine", "show", "not-hex", "--app", app, "--nats", nats_url],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
    assert shown.stderr == "fauxmad: invalid request: machine id must be 14 hex digits (0-9, a-f)\n", shown.stderr
