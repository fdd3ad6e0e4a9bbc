"""The edge proxy end to end: a real fleet (NATS, workers, a broker), real machines running
examples/echo/app.py, a real `fauxmad proxy` process, and a raw HTTP client.

Each test publishes its own app (a release in KV `fauxmad_apps` with an `[http_service]`) and makes
its machines through the broker, so tests share the fleet without seeing each other. The host-loss
test runs last: it kills a worker of region `pxb`.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from bus.contract import subjects
from bus.contract.machines import CORDONED_LABEL, Lease, LeaseRequest
from bus.transport.service import call
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture, until, wait_until
from tests.orchestrator import proxy_kit as kit

fleet = fleet_fixture(FleetSpec(regions=["pxa", "pxb"], workers_per_region=2, cpus=16, memory_mb=8192))


@pytest.fixture(scope="module")
def proxy(fleet: DevFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.ProxyProcess]:
    running = kit.ProxyProcess(fleet.url, "pxa", tmp_path_factory.mktemp("proxy"), "--latency", "pxb=30")
    yield running
    running.stop()


@pytest.fixture
def app(fleet: DevFleet, unique: Callable[[str], str]) -> Callable[..., tuple[str, list[str]]]:
    """Publish an app and make its machines: `app(service_toml, [(region, started?), ...])` -> (name, ids)."""

    def make(service: str = "", placed: list[tuple[str, bool]] | None = None) -> tuple[str, list[str]]:
        name = unique("web")
        spec = kit.spec_for(name, {"pxa": 1}, service)
        release = arun(kit.publish(fleet.url, spec))
        made = arun(kit.machines(fleet.url, spec, release, placed or []))
        return name, [m.id for m in made]

    return make


def state_of(fleet: DevFleet, app: str, machine_id: str) -> str:
    async def main() -> str:
        client = await FleetClient.connect(fleet.url)
        try:
            return (await client.get(app, machine_id, events=False)).state
        finally:
            await client.close()

    return arun(main())


def scrape(admin: int) -> str:
    """The proxy's /metrics, from its admin listener."""

    async def main() -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", admin)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: admin\r\n\r\n")
        data = await reader.read()
        writer.close()
        return data.decode()

    return arun(main())


def refusals(admin: int) -> dict[str, float]:
    """`fauxmad_proxy_refusals_total` by code: the answers the proxy wrote itself."""
    found = re.findall(r'^fauxmad_proxy_refusals_total\{code="(\d+)"\} (\S+)$', scrape(admin), re.M)
    return {code: float(value) for code, value in found}


def counted_since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {code: after[code] - before.get(code, 0.0) for code in after if after[code] != before.get(code, 0.0)}


def lines_of(proxy: kit.ProxyProcess, word: str) -> list[str]:
    """The proxy's output lines that say `word` (autostart, autostop)."""
    return [line for line in proxy.log_path.read_text().splitlines() if f"fauxmad proxy: {word}: " in line]


# ---------------------------------------------------------------------------------------------------
# routing


def test_the_host_picks_the_app_and_the_machine_sees_forwarded_headers(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    one, (one_id,) = app(placed=[("pxa", True)])
    two, (two_id,) = app(placed=[("pxa", True)])

    async def main() -> list[kit.Response]:
        client = kit.Client(proxy.port)
        try:
            out = [await client.request(f"{one}.localhost"), await client.request(f"{two}.localhost:8080")]
            out.append(await client.request(f"{one}.localhost", headers={"x-forwarded-for": "10.1.2.3"}))
            return out
        finally:
            await client.close()

    first, second, third = arun(main())
    assert (first.status, first.json()["machine"]) == (200, one_id)
    assert (second.status, second.json()["machine"]) == (200, two_id)
    seen = first.json()["headers"]
    assert seen["x-forwarded-for"] == "127.0.0.1" and seen["x-forwarded-proto"] == "http"
    assert seen["x-forwarded-host"] == f"{one}.localhost"
    assert seen["fauxmad-request-id"] == first.headers["fauxmad-request-id"]
    assert first.headers["fauxmad-machine"] == one_id and first.headers["connection"] == "keep-alive"
    # a client is no trusted hop (no --trusted-proxy): the address it claims is replaced, not extended
    assert third.json()["headers"]["x-forwarded-for"] == "127.0.0.1"


def test_unknown_apps_and_bad_hosts_are_answered_by_the_proxy(proxy: kit.ProxyProcess) -> None:
    before = refusals(proxy.admin)
    unknown = arun(kit.get(proxy.port, "nosuchapp.localhost"))
    assert unknown.status == 404 and unknown.body == b"unknown app nosuchapp\n"
    other_domain = arun(kit.get(proxy.port, "web.example.com"))
    assert other_domain.status == 404
    assert arun(kit.get(proxy.port, "bad host!")).status == 400
    # each counted in /metrics by code, though none names an app (the requests counter has no series for them)
    assert counted_since(before, refusals(proxy.admin)) == {"404": 2.0, "400": 1.0}
    assert "nosuchapp" not in scrape(proxy.admin)


def test_an_app_with_no_started_machine_and_no_autostart_is_a_502_saying_why(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, _ = app("auto_start = false", [("pxa", False)])
    deadline = time.monotonic() + 10.0
    while True:  # the proxy learns of the stopped machine from the routing index's watch, a moment after its create
        response = arun(kit.get(proxy.port, f"{name}.localhost"))
        if b"it has no machines" not in response.body or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert response.status == 502
    assert response.body.decode().startswith(f"no machine of {name} could take this request (none is started")


def test_the_preferred_region_goes_first(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, (near, far) = app(placed=[("pxa", True), ("pxb", True)])
    plain = arun(kit.get(proxy.port, f"{name}.localhost"))
    preferring = arun(kit.get(proxy.port, f"{name}.localhost", headers={"fauxmad-prefer-region": "pxb"}))
    assert plain.json()["machine"] == near
    assert preferring.json()["machine"] == far


def test_a_cordoned_machine_gets_no_request_until_uncordoned(proxy: kit.ProxyProcess, app, fleet: DevFleet) -> None:  # type: ignore[no-untyped-def]
    name, (kept, cordoned) = app("auto_start = false", [("pxa", True), ("pxa", True)])

    async def label(cordon: bool) -> None:
        client = await FleetClient.connect(fleet.url)
        try:
            got = await client.get(name, cordoned, events=False)
            labels = {k: v for k, v in got.config.metadata.items() if k != CORDONED_LABEL}
            if cordon:
                labels[CORDONED_LABEL] = "true"
            await client.update(name, cordoned, msgspec.structs.replace(got.config, metadata=labels))
        finally:
            await client.close()

    async def served(host: str, n: int) -> set[str]:
        client = kit.Client(proxy.port)
        try:
            return {(await client.request(host)).json()["machine"] for _ in range(n)}
        finally:
            await client.close()

    host = f"{name}.localhost"
    assert arun(served(host, 12)) == {kept, cordoned}  # ties at random: both serve
    arun(label(True))
    deadline = time.monotonic() + 5
    while arun(served(host, 1)) != {kept} or arun(served(host, 12)) != {kept}:  # the proxy's KV watch catches up
        assert time.monotonic() < deadline, "the cordoned machine still got requests"
    assert state_of(fleet, name, cordoned) == "started"  # cordoned, not stopped: the same process goes on
    arun(label(False))
    deadline = time.monotonic() + 5
    while cordoned not in arun(served(host, 12)):
        assert time.monotonic() < deadline, "the uncordoned machine got no request"


# ---------------------------------------------------------------------------------------------------
# limits


def test_a_machine_at_its_soft_limit_sends_the_next_request_to_another(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, ids = app(
        "auto_start = false\n[http_service.concurrency]\nsoft_limit = 1\nhard_limit = 5", [("pxa", True)] * 2
    )

    async def main() -> list[str]:
        slow = [asyncio.ensure_future(kit.get(proxy.port, f"{name}.localhost", "/slow?ms=1500")) for _ in range(2)]
        return [(await s).json()["machine"] for s in slow]

    assert sorted(arun(main())) == sorted(ids)


def test_at_the_hard_limit_a_request_waits_then_gets_a_503(fleet: DevFleet, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    quick = kit.ProxyProcess(fleet.url, "pxa", tmp_path, "--queue-timeout", "0.3")
    name, (_only,) = app(
        "auto_start = false\n[http_service.concurrency]\nsoft_limit = 1\nhard_limit = 2", [("pxa", True)]
    )

    async def main() -> tuple[list[int], kit.Response]:
        slow = [asyncio.ensure_future(kit.get(quick.port, f"{name}.localhost", "/slow?ms=3000")) for _ in range(2)]
        await asyncio.sleep(0.5)  # both are in flight
        over = await kit.get(quick.port, f"{name}.localhost")
        return [(await s).status for s in slow], over

    try:
        statuses, over = arun(main())
        counted = refusals(quick.admin)
    finally:
        quick.stop()
    assert statuses == [200, 200]
    assert over.status == 503 and over.headers["retry-after"] == "1"
    assert counted == {"503": 1.0}, counted
    assert over.body.decode() == f"every machine of {name} is at its hard limit\n"


def test_a_request_queued_at_the_hard_limit_is_served_when_a_slot_frees(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, (_only,) = app(
        "auto_start = false\n[http_service.concurrency]\nsoft_limit = 1\nhard_limit = 1", [("pxa", True)]
    )

    async def main() -> list[int]:
        first = asyncio.ensure_future(kit.get(proxy.port, f"{name}.localhost", "/slow?ms=500"))
        await asyncio.sleep(0.2)  # the first holds the only slot (its 500 ms answer) when the second comes
        second = await kit.get(proxy.port, f"{name}.localhost")
        return [(await first).status, second.status]

    assert arun(main()) == [200, 200]


# ---------------------------------------------------------------------------------------------------
# starting and creating machines inside a request


def test_autostart_starts_a_stopped_machine_and_serves_the_request_from_it(
    proxy: kit.ProxyProcess, app, fleet: DevFleet
) -> None:  # type: ignore[no-untyped-def]
    name, (stopped,) = app(placed=[("pxa", False)])
    assert state_of(fleet, name, stopped) == "created"
    response = arun(kit.get(proxy.port, f"{name}.localhost"))
    assert response.status == 200 and response.json()["machine"] == stopped
    assert state_of(fleet, name, stopped) == "started"
    # one line in the proxy's output: which machine, of which app, where and why
    assert lines_of(proxy, "autostart") and [line for line in lines_of(proxy, "autostart") if name in line] == [
        f"fauxmad proxy: autostart: started machine {stopped} of app {name} in pxa:"
        " a request found no started machine under its soft limit"
    ]


def test_over_the_soft_limit_autostart_starts_a_spare_in_the_nearest_region(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, (busy, _far_spare, near_spare) = app(
        "[http_service.concurrency]\nsoft_limit = 1\nhard_limit = 5", [("pxa", True), ("pxb", False), ("pxa", False)]
    )

    async def main() -> tuple[str, str]:
        held = asyncio.ensure_future(kit.get(proxy.port, f"{name}.localhost", "/slow?ms=1500"))
        await asyncio.sleep(0.3)  # the first is in flight (its 1.5 s answer) when the second comes: over the soft limit
        second = await kit.get(proxy.port, f"{name}.localhost")
        return (await held).json()["machine"], second.json()["machine"]

    assert arun(main()) == (busy, near_spare)


def test_scale_from_zero_creates_a_machine_inside_the_request(proxy: kit.ProxyProcess, app, fleet: DevFleet) -> None:  # type: ignore[no-untyped-def]
    name, _ = app("auto_create = true")

    async def main() -> list[kit.Response]:
        return list(await asyncio.gather(*(kit.get(proxy.port, f"{name}.localhost") for _ in range(5))))

    responses = arun(main())
    assert [r.status for r in responses] == [200] * 5
    machines = {r.json()["machine"] for r in responses}
    assert len(machines) == 1, "a burst shares one create (max_per_region = 1)"

    async def listed() -> list[dict[str, str]]:
        client = await FleetClient.connect(fleet.url)
        try:
            return [dict(m.config.metadata) | {"region": m.region} for m in await client.list(name)]
        finally:
            await client.close()

    (made,) = arun(listed())
    assert made["fauxmad_created_by"] == "proxy" and made["region"] == "pxa"
    assert [line for line in lines_of(proxy, "autostart") if name in line] == [
        f"fauxmad proxy: autostart: created machine {machines.pop()} of app {name} in pxa:"
        " a request found no machine to serve it in pxa"
    ]


def test_idle_machines_are_stopped_keeping_min_machines_running(proxy: kit.ProxyProcess, app, fleet: DevFleet) -> None:  # type: ignore[no-untyped-def]
    name, ids = app('auto_stop = "stop"\nidle_timeout = "1s"\nmin_machines_running = 1', [("pxa", True)] * 2)

    async def main() -> list[str]:
        client = await FleetClient.connect(fleet.url)
        try:
            assert (await kit.get(proxy.port, f"{name}.localhost")).status == 200
            for _ in range(100):  # the proxy's autostop round runs every second
                states = [(await client.get(name, i, events=False)).state for i in ids]
                if "stopped" in states:
                    await asyncio.sleep(2.5)  # another round or two: the second must stay
                    return [(await client.get(name, i, events=False)).state for i in ids]
                await asyncio.sleep(0.1)
            return states
        finally:
            await client.close()

    states = arun(main())
    assert sorted(states) == ["started", "stopped"]
    stopped = ids[states.index("stopped")]
    (line,) = [line for line in lines_of(proxy, "autostop") if name in line]  # the one stopped, not the one kept
    assert re.fullmatch(
        rf"fauxmad proxy: autostop: machine {stopped} of app {name} stopped in pxa: no request for \d+s"
        r" \(idle_timeout 1s\)",
        line,
    ), line
    # and a request afterwards is served by the one kept (or wakes the other): never an error
    assert arun(kit.get(proxy.port, f"{name}.localhost")).status == 200


def test_idle_machines_are_suspended_and_a_request_resumes_the_same_process(
    proxy: kit.ProxyProcess, app, fleet: DevFleet
) -> None:  # type: ignore[no-untyped-def]
    name, (machine_id,) = app('auto_stop = "suspend"\nidle_timeout = "1s"', [("pxa", True)])

    async def main() -> tuple[list[str], float, str]:
        client = await FleetClient.connect(fleet.url)
        try:
            first = await kit.get(proxy.port, f"{name}.localhost")
            assert first.status == 200
            seen = []
            for _ in range(100):  # the proxy's autostop round runs every second
                state = (await client.get(name, machine_id, events=False)).state
                seen.append(state)
                if state == "suspended":
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)  # the proxy's replica of the index sees it suspended
            started = time.perf_counter()
            again = await kit.get(proxy.port, f"{name}.localhost")
            took = time.perf_counter() - started
            assert again.status == 200 and again.json()["machine"] == machine_id
            assert again.json()["pid"] == first.json()["pid"], "resumed, not restarted: the same process"
            return seen, took, (await client.get(name, machine_id, events=False)).state
        finally:
            await client.close()

    seen, took, after = arun(main())
    assert seen[-1] == "suspended" and after == "started"

    def auto_lines() -> list[list[str]]:
        return [
            line.split(": ", 2)[1:]
            for line in proxy.log_path.read_text().splitlines()
            if line.startswith("fauxmad proxy: auto") and f" of app {name} " in line
        ]

    # The GET went ahead of the resume on a connection kept from before the freeze: the machine can answer it
    # as soon as its worker thaws it, before the worker's reply to the resume reaches the proxy, and the proxy
    # says "resumed" on that reply (CI: the answer and the worker's `started` were in, the line not yet).
    said = wait_until(lambda: auto_lines()[1:] and auto_lines(), "the proxy's autostart line after the resumed answer")
    assert [what for what, _ in said] == ["autostop", "autostart"], said
    assert said[0][1].startswith(f"machine {machine_id} of app {name} suspended in pxa: no request for")
    assert said[1][1].startswith(f"resumed machine {machine_id} of app {name} in pxa: a request found")
    print(f"\nfirst byte after resume from suspend: {took * 1000:.1f} ms")


def test_a_refused_resume_sends_the_request_to_another_machine_at_once(
    proxy: kit.ProxyProcess, app, fleet: DevFleet
) -> None:  # type: ignore[no-untyped-def]
    """A GET goes to a suspended machine as its resume is asked for (on a connection kept from before); when
    the worker refuses the resume (a lease held by someone else), the request is not left in the frozen
    machine's socket: the proxy starts the other machine and that one answers."""
    name, (frozen_id, spare_id) = app("", [("pxa", True), ("pxa", False)])

    async def main() -> tuple[kit.Response, float, str]:
        client = await FleetClient.connect(fleet.url)
        try:
            assert (await kit.get(proxy.port, f"{name}.localhost")).json()["machine"] == frozen_id
            await client.suspend(name, frozen_id)
            lease = LeaseRequest(id=frozen_id, ttl=60, holder="a test")
            await call(client.nc, subjects.api_machines(name, "lease"), lease, Lease)
            await asyncio.sleep(0.3)  # the proxy's replica of the index sees it suspended
            started = time.perf_counter()
            served = await asyncio.wait_for(kit.get(proxy.port, f"{name}.localhost"), 20)
            took = time.perf_counter() - started
            return served, took, (await client.get(name, frozen_id, events=False)).state
        finally:
            await client.close()

    served, took, frozen_state = arun(main())
    assert served.status == 200 and served.json()["machine"] == spare_id, served.body
    assert frozen_state == "suspended"
    print(f"\nserved by the spare after the refused resume in {took * 1000:.1f} ms")


# An app that, when it is continued, drops every connection it kept (unread: a reset), as an app whose idle
# timers fire first after a long freeze would. One thread, blocked in select(): a SIGCONT runs the handler
# before anything queued is read.
DROPS_KEPT_ON_CONTINUE = """
import os, select, signal, socket, struct
listener = socket.create_server(("127.0.0.1", int(os.environ["PORT"])))
kept = {}
def drop_kept(*_):
    for conn in list(kept):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
        del kept[conn]
signal.signal(signal.SIGCONT, drop_kept)
while True:
    try:
        ready = select.select([listener, *kept], [], [])[0]
    except (OSError, ValueError):  # a connection dropped while select() waited on it
        continue
    for sock in ready:
        if sock is listener:
            kept[listener.accept()[0]] = b""
            continue
        data = sock.recv(65536)
        if not data:
            sock.close()
            del kept[sock]
            continue
        kept[sock] += data
        while b"\\r\\n\\r\\n" in kept[sock]:
            kept[sock] = kept[sock].partition(b"\\r\\n\\r\\n")[2]
            body = str(os.getpid()).encode()
            sock.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: %d\\r\\n\\r\\n" % len(body) + body)
"""


def test_a_kept_connection_the_resumed_machine_drops_is_retried_on_a_new_one(
    proxy: kit.ProxyProcess, fleet: DevFleet, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The request went ahead of the resume on a kept connection, and the machine, once continued, reset
    that connection before reading it: the proxy waits for the resume and sends the request again on a new
    connection to the same machine (it is safe to), instead of counting the machine as unreachable."""
    script = tmp_path / "drops_kept.py"
    script.write_text(DROPS_KEPT_ON_CONTINUE)
    name = unique("web")
    spec = kit.parse_spec(
        f'app = "{name}"\ncmd = ["python3", "-S", "{script}"]\n[guest]\nmemory_mb = 64\n[regions]\npxa = 1\n'
        "[http_service]\n"
    )
    release = arun(kit.publish(fleet.url, spec))
    (machine,) = arun(kit.machines(fleet.url, spec, release, [("pxa", True)]))

    async def main() -> tuple[kit.Response, kit.Response, str]:
        client = await FleetClient.connect(fleet.url)
        try:
            first = await kit.get(proxy.port, f"{name}.localhost")  # the proxy keeps this connection
            await client.suspend(name, machine.id)
            await asyncio.sleep(0.3)  # the proxy's replica of the index sees it suspended
            again = await asyncio.wait_for(kit.get(proxy.port, f"{name}.localhost"), 20)
            return first, again, (await client.get(name, machine.id, events=False)).state
        finally:
            await client.close()

    first, again, state = arun(main())
    assert first.status == 200
    assert again.status == 200, again.body
    assert again.body == first.body, "the same process answered"
    assert state == "started"


# ---------------------------------------------------------------------------------------------------
# bodies, upgrades, malformed requests


def test_bodies_stream_both_ways(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, _ = app(placed=[("pxa", True)])

    async def main() -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(f"POST /echo HTTP/1.1\r\nhost: {name}.localhost\r\ntransfer-encoding: chunked\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        echoed = []
        for piece in (b"first", b"second", b"third"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            size = int(await reader.readuntil(b"\r\n"), 16)  # the echo of this piece, before the next is sent
            echoed.append(await reader.readexactly(size))
            await reader.readexactly(2)
        writer.write(b"0\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"0\r\n\r\n"
        writer.close()
        return echoed

    assert arun(main()) == [b"first", b"second", b"third"]


def test_a_large_body_arrives_whole(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, _ = app(placed=[("pxa", True)])
    body = os.urandom(3 * 1024 * 1024)
    response = arun(kit.get(proxy.port, f"{name}.localhost", "/echo", method="POST", body=body))
    assert response.status == 200 and response.body == body


def test_a_websocket_echoes_through_the_proxy(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, _ = app(placed=[("pxa", True)])

    async def main() -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET /ws HTTP/1.1\r\nhost: {name}.localhost\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            f"sec-websocket-key: {key}\r\nsec-websocket-version: 13\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        mask = os.urandom(4)
        payload = b"hello over the edge"
        writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        _first, second = await reader.readexactly(2)
        echoed = await reader.readexactly(second & 0x7F)
        writer.close()
        return head, echoed

    head, echoed = arun(main())
    assert head.startswith(b"HTTP/1.1 101"), head
    assert echoed == b"hello over the edge"


def test_malformed_requests_get_4xx_or_are_cut_and_the_proxy_stays_up(fleet: DevFleet, app, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    strict = kit.ProxyProcess(fleet.url, "pxa", tmp_path, "--head-timeout", "0.5")
    name, _ = app(placed=[("pxa", True)])

    async def raw(data: bytes, *, trickle: bool = False) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", strict.port)
        try:
            if trickle:  # slowloris: a byte now and then, never the whole head
                for byte in data:
                    # the proxy cut it: an EOF, or a reset that closed the transport without one (CI39: the next
                    # write raised "the handler is closed")
                    if reader.at_eof() or writer.is_closing():
                        break
                    writer.write(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.2)
            else:
                writer.write(data)
            return await asyncio.wait_for(reader.read(), 10)
        except ConnectionError:
            return b""
        finally:
            writer.close()

    async def main() -> dict[str, bytes]:
        host = f"host: {name}.localhost\r\n".encode()
        return {
            "garbage": await raw(b"\x16\x03\x01 hello\r\n\r\n"),
            "no host": await raw(b"GET / HTTP/1.1\r\n\r\n"),
            "bad header": await raw(b"GET / HTTP/1.1\r\n" + host + b"bad header\r\n\r\n"),
            "smuggling": await raw(
                b"POST / HTTP/1.1\r\n" + host + b"content-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
            ),
            "huge": await raw(b"GET / HTTP/1.1\r\n" + host + b"x-big: " + b"a" * 100_000 + b"\r\n\r\n"),
            "slowloris": await raw(b"GET / HTTP/1.1\r\n" + host + b"x-slow: " + b"a" * 40, trickle=True),
            "http2": await raw(b"GET / HTTP/2.0\r\n" + host + b"\r\n"),
        }

    try:
        answers = arun(main())
        after = arun(kit.get(strict.port, f"{name}.localhost"))
        alive = strict.alive()
        counted = refusals(strict.admin)
    finally:
        strict.stop()
    # every answer the proxy wrote itself is counted by its code (a 431 or 408 even when the client, cut, missed it)
    assert counted == {"400": 4.0, "431": 1.0, "408": 1.0, "505": 1.0}, counted
    assert answers["garbage"].startswith(b"HTTP/1.1 400")
    assert answers["no host"].startswith(b"HTTP/1.1 400")
    assert answers["bad header"].startswith(b"HTTP/1.1 400")
    assert answers["smuggling"].startswith(b"HTTP/1.1 400")
    assert answers["huge"].startswith(b"HTTP/1.1 431") or answers["huge"] == b""
    # cut at the head timeout: the 408 arrives, or the next trickled byte finds the connection reset
    # (a proxy that never cut would leave the read above to time out: an error, not a pass)
    assert answers["slowloris"].startswith(b"HTTP/1.1 408") or answers["slowloris"] == b""
    assert answers["http2"].startswith(b"HTTP/1.1 505")
    assert after.status == 200 and alive
    assert b"Traceback" not in strict.log_path.read_bytes()


def test_metrics_count_requests_by_app_and_status(proxy: kit.ProxyProcess, app) -> None:  # type: ignore[no-untyped-def]
    name, _ = app(placed=[("pxa", True)])
    for _ in range(3):
        assert arun(kit.get(proxy.port, f"{name}.localhost")).status == 200

    text = scrape(proxy.admin)
    assert f'fauxmad_proxy_requests_total{{app="{name}",region="pxa",status="200"}} 3.0' in text
    assert f'fauxmad_proxy_request_seconds_count{{app="{name}"}} 3.0' in text


# ---------------------------------------------------------------------------------------------------
# failover (last: it kills a host of pxb)


def test_a_host_killed_mid_load_fails_no_get_and_is_signalled(proxy: kit.ProxyProcess, app, fleet: DevFleet) -> None:  # type: ignore[no-untyped-def]
    name, ids = app(placed=[("pxb", True), ("pxb", True)])

    async def where() -> dict[str, str]:
        client = await FleetClient.connect(fleet.url)
        try:
            return {i: (await client.get(name, i, events=False)).worker_id for i in ids}
        finally:
            await client.close()

    workers = arun(where())
    assert len(set(workers.values())) == 2, "the spread scorer puts an app's two machines on two workers"
    victim = workers[ids[0]]

    async def main() -> tuple[list[int], list[dict[str, str]]]:
        nc = await connect_nats(fleet.url)
        signals: list[dict[str, str]] = []

        async def heard(msg: object) -> None:
            signals.append(msgspec.json.decode(msg.data))  # type: ignore[attr-defined]

        await nc.subscribe(f"fauxmad.v1.proxy.unreachable.{name}.>", cb=heard)
        statuses: list[int] = []
        clients = [kit.Client(proxy.port) for _ in range(4)]

        async def load(client: kit.Client, rounds: int) -> None:
            for _ in range(rounds):
                statuses.append(
                    (await client.request(f"{name}.localhost", headers={"fauxmad-prefer-region": "pxb"})).status
                )

        await asyncio.gather(*(load(c, 25) for c in clients))
        fleet.kill_host(victim)
        await asyncio.gather(*(load(c, 50) for c in clients))

        async def signalled() -> bool:
            return bool(signals)

        await until(signalled, "the proxy's signal that it could not reach the victim", 10)
        await nc.close()
        for c in clients:
            await c.close()
        return statuses, signals

    statuses, signals = arun(main())
    assert statuses == [200] * 300
    assert signals and signals[0]["machine_id"] == ids[0] and signals[0]["worker_id"] == victim


def test_a_machine_slower_than_the_response_timeout_gets_a_504_and_the_proxy_serves_on(
    fleet: DevFleet, app, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    name, _ = app(placed=[("pxa", True)])
    quick = kit.ProxyProcess(fleet.url, "pxa", tmp_path, "--response-timeout", "0.5")
    try:
        slow = arun(kit.get(quick.port, f"{name}.localhost", "/slow?ms=3000"))  # it would answer 200 at 3 s
        assert slow.status == 504 and b"did not answer within 0.5s" in slow.body
        assert arun(kit.get(quick.port, f"{name}.localhost")).status == 200
    finally:
        quick.stop()
