"""Request smuggling against the edge, with raw sockets (issue 39): each case's bytes, then a probe.

A real dev fleet runs one machine, tests/orchestrator/proxy/recording_machine.py, that parses requests the
lenient way many servers do and logs every one it parses; a real `fauxmad proxy` stands in front of it.
Each case sends its bytes on a fresh client connection and checks what the client got; then a probe
goes on the same connection if it is still open (else on a new one) and must get its own answer; then
the machine's log must hold exactly the requests the case meant to forward and the probe: zero hidden
requests, zero desyncs. Last, test_proxy_h11's hypothesis corpus goes through the real proxy the same way:
what the machine parsed of each request must be what h11 reads in it, and nothing where h11 refuses it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bus.contract.fleet import CreateRequest
from orchestrator.apps.spec import PRIMARY, parse_spec
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.proxy.upstream import connect_when_up
from tests.helpers import arun, fleet_fixture
from tests.orchestrator import proxy_kit as kit
from tests.orchestrator.proxy import test_proxy_h11 as differential
from tests.orchestrator.proxy.smuggling_cases import refused_cases

REGION = "pxs"
APP = "recorder"
RECORDER = Path(__file__).resolve().parent / "recording_machine.py"
WAIT = 15.0  # seconds a test waits for an answer: a proxy that waits out its 30 s response timeout fails


class Machine(NamedTuple):
    app: str
    log: Path

    def parsed(self) -> list[dict[str, object]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line]


fleet = fleet_fixture(FleetSpec(regions=[REGION], workers_per_region=1, cpus=8, memory_mb=4096))


@pytest.fixture(scope="module")
def machine(fleet: DevFleet, tmp_path_factory: pytest.TempPathFactory) -> Machine:
    log = tmp_path_factory.mktemp("recorder") / "requests.jsonl"
    spec = parse_spec(
        f'app = "{APP}"\ncmd = ["{sys.executable}", "{RECORDER}", "{log}"]\n[guest]\nmemory_mb = 64\n'
        f"[regions]\n{REGION} = 1\n[http_service]\n"
    )
    release = arun(kit.publish(fleet.url, spec))

    async def create() -> None:
        client = await FleetClient.connect(fleet.url)
        try:
            config = spec.machine_config(release, PRIMARY)
            made = await client.create(APP, CreateRequest(region=REGION, config=config))
            assert made.port is not None
            conn = await connect_when_up(("127.0.0.1", made.port), 10.0)
            assert conn is not None, "the recording machine never listened"
            conn.close()
        finally:
            await client.close()

    arun(create())
    return Machine(APP, log)


@pytest.fixture(scope="module")
def proxy(fleet: DevFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.ProxyProcess]:
    running = kit.ProxyProcess(
        fleet.url, REGION, tmp_path_factory.mktemp("proxy"), "--head-timeout", "1", "--response-timeout", "30"
    )
    yield running
    running.stop()
    assert b"Traceback" not in running.log_path.read_bytes()


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes


async def read_answer(reader: asyncio.StreamReader) -> Answer | None:
    """One response (None: the connection closed first)."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), WAIT)
    return Answer(int(lines[0].split(" ")[1]), headers, body)


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), WAIT) == b""
    except ConnectionError:
        return True


def probe_bytes(app: str, tag: str) -> bytes:
    return f"GET /probe-{tag} HTTP/1.1\r\nHost: {app}.localhost\r\n\r\n".encode()


class Outcome(NamedTuple):
    first: Answer | None
    closed: bool  # the proxy closed the client connection after its answer
    probe: Answer | None
    parsed: list[dict[str, object]]  # what the machine parsed, the probe included
    tag: str


def attack(proxy: kit.ProxyProcess, machine: Machine, data: bytes) -> Outcome:
    """Send `data`, read the answer, then a probe (same connection if open); what the machine parsed."""
    tag = secrets.token_hex(4)
    before = len(machine.parsed())

    async def main() -> tuple[Answer | None, bool, Answer | None]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(data)
            first = await read_answer(reader)
            shut = first is None or first.headers.get("connection") == "close"
            if shut:
                assert await closed(reader), "the proxy said close but kept the connection"
            else:
                writer.write(probe_bytes(machine.app, tag))
                return first, False, await read_answer(reader)
        finally:
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(probe_bytes(machine.app, tag))
            return first, True, await read_answer(reader)
        finally:
            writer.close()

    first, shut, probe = arun(main())
    return Outcome(first, shut, probe, machine.parsed()[before:], tag)


def assert_probe_answered(outcome: Outcome) -> None:
    assert outcome.probe is not None and outcome.probe.status == 200
    assert json.loads(outcome.probe.body)["target"] == f"/probe-{outcome.tag}"  # its own answer: no desync


def host(machine: Machine) -> bytes:
    return f"Host: {machine.app}.localhost\r\n".encode()


REFUSED = list(refused_cases(APP))


@pytest.mark.parametrize("case", REFUSED)
def test_an_ambiguous_request_is_a_400_and_the_connection_closes(
    proxy: kit.ProxyProcess, machine: Machine, case: str
) -> None:
    outcome = attack(proxy, machine, refused_cases(machine.app)[case])
    assert outcome.first is not None and outcome.first.status == 400, outcome.first
    assert outcome.closed
    assert_probe_answered(outcome)
    assert [entry["target"] for entry in outcome.parsed] == [f"/probe-{outcome.tag}"]


def test_a_lowercase_method_is_forwarded_as_written(proxy: kit.ProxyProcess, machine: Machine) -> None:
    outcome = attack(proxy, machine, b"get /lower HTTP/1.1\r\n" + host(machine) + b"\r\n")
    assert outcome.first is not None and outcome.first.status == 200 and not outcome.closed
    assert_probe_answered(outcome)
    assert [(e["method"], e["target"]) for e in outcome.parsed] == [("get", "/lower"), ("GET", f"/probe-{outcome.tag}")]


def test_an_absolute_form_targets_authority_wins_over_host(proxy: kit.ProxyProcess, machine: Machine) -> None:
    data = f"GET http://{machine.app}.localhost/abs?q=1 HTTP/1.1\r\nHost: nosuchapp.localhost\r\n\r\n".encode()
    outcome = attack(proxy, machine, data)
    assert outcome.first is not None and outcome.first.status == 200 and not outcome.closed
    assert_probe_answered(outcome)
    first = outcome.parsed[0]
    assert first["target"] == "/abs?q=1"
    fields = first["fields"]
    assert isinstance(fields, list)
    assert [value for name, value in fields if name == "host"] == [f"{machine.app}.localhost"]
    assert len(outcome.parsed) == 2

    other = f"GET http://nosuchapp.localhost/ HTTP/1.1\r\nHost: {machine.app}.localhost\r\n\r\n".encode()
    routed_away = attack(proxy, machine, other)
    assert routed_away.first is not None and routed_away.first.status == 404
    assert_probe_answered(routed_away)
    assert len(routed_away.parsed) == 1


def test_a_chunked_upload_arrives_reframed_with_its_trailers_dropped(proxy: kit.ProxyProcess, machine: Machine) -> None:
    data = (
        b"POST /chunks HTTP/1.1\r\n"
        + host(machine)
        + b"Transfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    outcome = attack(proxy, machine, data)
    assert outcome.first is not None and outcome.first.status == 200 and not outcome.closed
    assert_probe_answered(outcome)
    upload = outcome.parsed[0]
    assert upload["body"] == "hello world"
    assert len(outcome.parsed) == 2


def test_forwarding_fields_from_a_client_are_replaced(proxy: kit.ProxyProcess, machine: Machine) -> None:
    claims = b"Forwarded: for=6.6.6.6\r\nX-Real-IP: 6.6.6.6\r\nFly-Client-IP: 6.6.6.6\r\nX-Forwarded-For: 6.6.6.6\r\n"
    claims += b"X-Forwarded-Proto: https\r\nX-Forwarded-Host: evil\r\nX-Forwarded-Port: 1\r\n"
    outcome = attack(proxy, machine, b"GET /who HTTP/1.1\r\n" + host(machine) + claims + b"\r\n")
    assert outcome.first is not None and outcome.first.status == 200
    fields = outcome.parsed[0]["fields"]
    assert isinstance(fields, list)
    seen = {name: value for name, value in fields}
    assert seen["x-forwarded-for"] == "127.0.0.1" and seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-host"] == f"{machine.app}.localhost"
    assert not {"forwarded", "x-real-ip", "fly-client-ip", "x-forwarded-port"} & set(seen)


def test_a_trusted_hops_forwarding_fields_are_kept_and_extended(
    fleet: DevFleet, machine: Machine, tmp_path: Path
) -> None:
    trusting = kit.ProxyProcess(fleet.url, REGION, tmp_path, "--trusted-proxy", "127.0.0.0/8")
    try:
        claims = b"X-Forwarded-For: 10.1.2.3\r\nX-Forwarded-Proto: https\r\nX-Real-IP: 10.1.2.3\r\n"
        outcome = attack(trusting, machine, b"GET /trusted HTTP/1.1\r\n" + host(machine) + claims + b"\r\n")
    finally:
        trusting.stop()
    fields = outcome.parsed[0]["fields"]
    assert isinstance(fields, list)
    seen = {name: value for name, value in fields}
    assert seen["x-forwarded-for"] == "10.1.2.3, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https" and seen["x-real-ip"] == "10.1.2.3"


def test_an_early_response_ends_the_uploads_connection_and_another_client_gets_its_answer(
    proxy: kit.ProxyProcess, machine: Machine
) -> None:
    """The machine answers `POST /early` before reading its body; the rest of the body must not share a
    kept connection with another client's request (which the machine would read as upload bytes)."""
    tag = secrets.token_hex(4)
    before = len(machine.parsed())

    async def main() -> tuple[Answer | None, Answer | None, bool]:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            up_writer.write(
                b"POST /early HTTP/1.1\r\n" + host(machine) + b"Content-Length: 100000\r\n\r\n" + b"a" * 100
            )
            early = await read_answer(up_reader)
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(probe_bytes(machine.app, tag))
                other = await read_answer(reader)
            finally:
                writer.close()
            up_writer.write(b"a" * 1000)  # the upload goes on: it must reach nobody else's request
            return early, other, await closed(up_reader)
        finally:
            up_writer.close()

    early, other, upload_closed = arun(main())
    assert early is not None and early.status == 200 and early.headers["connection"] == "close"
    assert upload_closed
    assert other is not None and other.status == 200
    assert json.loads(other.body)["target"] == f"/probe-{tag}"
    assert [entry["target"] for entry in machine.parsed()[before:]] == ["/early", f"/probe-{tag}"]


def test_a_kept_connection_trickling_its_next_head_is_cut_at_the_head_timeout(
    proxy: kit.ProxyProcess, machine: Machine
) -> None:
    """--head-timeout 1 here, the keep-alive timeout 75 s: the second head trickles a byte every 0.3 s."""
    before = len(machine.parsed())

    async def main() -> tuple[Answer | None, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(b"GET /first HTTP/1.1\r\n" + host(machine) + b"\r\n")
            first = await read_answer(reader)
            slow = b"GET /second HTTP/1.1\r\n" + host(machine) + b"X-Slow: " + b"a" * 60
            for byte in slow:  # 22 s in all: a proxy that waits the keep-alive timeout never answers
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.sleep(0.3)
                if reader.at_eof():
                    break
            try:
                return first, await asyncio.wait_for(reader.read(), 1)
            except ConnectionError:
                return first, b""
        finally:
            writer.close()

    first, rest = arun(main())
    assert first is not None and first.status == 200
    assert rest.startswith(b"HTTP/1.1 408") or rest == b""  # the 408, or the connection reset under it
    assert [entry["target"] for entry in machine.parsed()[before:]] == ["/first"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.one_of(differential.valid, differential.valid, differential.requests, differential.with_host))
def test_through_the_real_proxy_the_machine_parses_exactly_what_h11_accepts(
    proxy: kit.ProxyProcess, machine: Machine, data: bytes
) -> None:
    """The differential test (test_proxy_h11) end to end: the hypothesis corpus sent to the real proxy; what
    the recording machine parsed of it must be what h11 reads in it (nothing, where h11 refuses), and a
    probe after it must get its own answer."""
    data = data.replace(b"a.localhost", f"{machine.app}.localhost".encode())
    outcome = attack(proxy, machine, data)
    assert_probe_answered(outcome)
    *forwarded, probe = outcome.parsed
    assert probe["target"] == f"/probe-{outcome.tag}"
    reference = differential.h11_reads(data)
    event(f"machine parsed it: {bool(forwarded)}, h11 accepts it: {reference is not None}")
    if not forwarded:
        return
    assert reference is not None, f"the machine parsed what h11 refuses: {data!r}"
    (seen,) = forwarded
    method, target, fields, body = differential._as_sent(reference)
    assert (seen["method"], seen["target"]) == (method.decode("latin-1"), target.decode("latin-1"))
    assert seen["body"] == body.decode("latin-1")
    pairs = seen["fields"]
    assert isinstance(pairs, list)
    got = [(n, v) for n, v in pairs if n.encode() not in differential.OWNED and not n.startswith("x-forwarded-")]
    assert got == [(n.decode("latin-1"), v.decode("latin-1")) for n, v in fields]


@pytest.mark.parametrize(
    "rest",
    [
        b"Content-Length: 100\r\n\r\n0123456789",
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello",
    ],
    ids=["a length not reached", "inside a chunk", "before a chunk's terminator"],
)
def test_a_stalled_body_is_a_408_at_the_head_timeout_not_the_response_timeout(
    proxy: kit.ProxyProcess, machine: Machine, rest: bytes
) -> None:
    """--head-timeout 1, --response-timeout 30 here, and the client waits 15 s: a proxy that left the machine
    waiting for the body until its response timeout would not answer in time."""
    outcome = attack(proxy, machine, b"POST /stalled HTTP/1.1\r\n" + host(machine) + rest)
    assert outcome.first is not None and outcome.first.status == 408 and outcome.closed
    assert_probe_answered(outcome)
    assert [entry["target"] for entry in outcome.parsed] == [f"/probe-{outcome.tag}"]
