"""The edge proxy's pure parts: the choice of machine, region order, idle victims, HTTP head parsing."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from orchestrator.proxy.choose import Candidate, Create, NoMachine, Policy, Route, Start, Wait, choose, region_order
from orchestrator.proxy.http import HttpError, copy_chunked, parse_response, parse_response_head, split_host
from orchestrator.proxy.idle import IdleStopper, idle_victims
from orchestrator.proxy.metrics import BUCKETS, ProxyMetrics, Served
from orchestrator.proxy.pick import Picker
from orchestrator.proxy.request import origin_form, parse_request
from orchestrator.proxy.routes import RouteTable

POLICY = Policy(soft_limit=2, hard_limit=4, auto_start=True, auto_create=False, max_per_region=1)
ORDER = ["mad", "lhr", "syd"]


def pick(candidates: list[Candidate], policy: Policy = POLICY, avoid: frozenset[str] = frozenset()) -> object:
    return choose(candidates, policy, ORDER, random.Random(7), avoid)


def test_regions_go_preferred_then_own_then_by_latency() -> None:
    assert region_order({"syd", "lhr", "gru", "mad"}, "mad", None, {"lhr": 20, "syd": 300}) == [
        "mad",
        "lhr",
        "syd",
        "gru",
    ]
    assert region_order({"syd", "mad"}, "mad", "syd", {}) == ["syd", "mad"]


def test_the_least_loaded_machine_under_the_soft_limit_in_the_nearest_region_wins() -> None:
    machines = [
        Candidate("a", "mad", "started", 1),
        Candidate("b", "mad", "started", 0),
        Candidate("c", "lhr", "started", 0),
    ]
    assert pick(machines) == Route("b")


def test_a_farther_region_under_its_soft_limit_beats_a_near_one_over_it() -> None:
    machines = [Candidate("a", "mad", "started", 2), Candidate("c", "lhr", "started", 1)]
    assert pick(machines, POLICY._replace(auto_start=False)) == Route("c")


def test_ties_are_broken_at_random() -> None:
    machines = [Candidate(x, "mad", "started", 0) for x in "abcdef"]
    seen = {choose(machines, POLICY, ORDER, random.Random(seed)) for seed in range(40)}
    assert len(seen) > 1


def test_all_over_the_soft_limit_starts_a_stopped_machine_nearest_first() -> None:
    machines = [
        Candidate("a", "mad", "started", 2),
        Candidate("s", "syd", "stopped", 0),
        Candidate("t", "lhr", "created", 0),
    ]
    assert pick(machines) == Start("t")


def test_a_machine_still_stopping_is_started_and_a_suspending_one_resumed() -> None:
    """CI110: a request met the app's one machine halfway through its autostop (`stopping`) and got a 502, "none is
    started". Its worker's start waits for the stop to end, so the edge starts it; a stopped one goes first."""
    assert pick([Candidate("s", "mad", "stopping", 0)]) == Start("s")
    assert pick([Candidate("p", "mad", "suspending", 0)]) == Start("p")
    assert pick([Candidate("s", "mad", "stopping", 0), Candidate("t", "mad", "stopped", 0)]) == Start("t")
    assert pick([Candidate("s", "mad", "stopping", 0), Candidate("t", "syd", "stopped", 0)]) == Start("t")
    off = pick([Candidate("s", "mad", "stopping", 0)], POLICY._replace(auto_start=False))
    assert off == NoMachine("none is started (states: stopping) and auto_start is off")


def test_without_autostart_a_machine_over_its_soft_limit_but_under_hard_takes_it() -> None:
    machines = [Candidate("a", "mad", "started", 3), Candidate("s", "mad", "stopped", 0)]
    assert pick(machines, POLICY._replace(auto_start=False)) == Route("a")


def test_at_the_hard_limit_everywhere_the_request_waits() -> None:
    assert pick([Candidate("a", "mad", "started", 4)]) == Wait()


def test_auto_create_fills_the_nearest_region_with_room() -> None:
    policy = POLICY._replace(auto_create=True)
    assert pick([], policy) == Create("mad")
    assert pick([Candidate("a", "mad", "started", 4)], policy) == Create("lhr")


def test_no_machine_says_why() -> None:
    assert pick([], POLICY) == NoMachine("it has no machines (auto_create is off)")
    refused = pick([Candidate("a", "mad", "started", 0)], avoid=frozenset({"a"}))
    assert refused == NoMachine("1 machine(s) refused the connection or failed")
    off = pick([Candidate("s", "mad", "stopped", 0)], POLICY._replace(auto_start=False))
    assert off == NoMachine("none is started (states: stopped) and auto_start is off")


@pytest.mark.parametrize("state", ["started", "stopped", "suspended"])
@pytest.mark.parametrize("load", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("avoided", [False, True])
def test_one_machines_shortcut_routes_only_where_choose_routes_the_same(state: str, load: int, avoided: bool) -> None:
    """`Picker._one` skips `choose` for an app of one machine; whenever it answers, `choose` answers the same."""
    picker = SimpleNamespace(failover=SimpleNamespace(bad={}))
    only = [Candidate("m1", "lhr", state, load)]
    avoid = {"m1"} if avoided else set()
    shortcut = Picker._one(picker, only, POLICY, avoid)  # type: ignore[arg-type]
    full = choose(only, POLICY, ORDER, random.Random(0), frozenset(avoid))
    assert shortcut is None or shortcut == full
    assert (shortcut is not None) == (state == "started" and load < POLICY.soft_limit and not avoided)
    picker.failover.bad = {"m2": 1.0}  # a machine avoided lately: the full choice, which reads the failover
    assert Picker._one(picker, only, POLICY, avoid) is None  # type: ignore[arg-type]


def test_idle_victims_keep_min_running_and_the_nearest() -> None:
    machines = [
        Candidate("a", "mad", "started", 0),
        Candidate("b", "syd", "started", 0),
        Candidate("c", "lhr", "started", 1),
    ]
    used = {"a": 0.0, "b": 0.0, "c": 0.0}
    everyone = lambda region, running: running  # noqa: E731  (no floor: every idle one may go)
    assert idle_victims(machines, used, 100.0, 60.0, everyone, ORDER) == ["b", "a"]
    assert idle_victims(machines, used, 100.0, 60.0, lambda r, n: 0 if r == "mad" else n, ORDER) == ["b"]
    assert idle_victims(machines, {"a": 90.0, "b": 90.0}, 100.0, 60.0, everyone, ORDER) == []


def test_a_machine_started_again_gets_a_whole_idle_timeout_from_its_start() -> None:
    """CI105: a proxy kept what it knew of a machine's use from before its stop (another proxy stopped it), and
    stopped it a moment after it was started again for a request. Its idle clock starts again at each start."""
    stopper = IdleStopper(RouteTable(), None, {}, {}, region="mad", latency={}, clock=lambda: 0.0)  # type: ignore[arg-type]
    everyone = lambda region, running: running  # noqa: E731  (no floor: every idle one may go)

    def victims(state: str, now: float) -> list[str]:
        machines = [Candidate("m1", "mad", state, 0)]
        stopper.note_states(machines, now)
        return idle_victims(machines, stopper._used_anywhere(), now, 2.0, everyone, ["mad"])

    assert victims("started", 0.0) == []  # first seen started: the clock starts
    stopper.heard(["m1"])  # another proxy used it (at 0.0, the stopper's clock)
    assert victims("started", 2.5) == ["m1"]  # idle for its timeout: stopped (by this proxy or another)
    assert victims("stopped", 3.0) == []
    assert victims("starting", 9.0) == []
    assert victims("started", 10.0) == []  # started again for a request: a whole timeout from now
    assert victims("started", 11.5) == []
    assert victims("started", 12.0) == ["m1"]


def test_a_request_head_parses_and_hosts_name_apps() -> None:
    head = parse_request(b"GET /x HTTP/1.1\r\nHost: web.localhost:8080\r\nX-A:  b \r\n\r\n").head
    assert (head.first, head.target, head.get(b"x-a")) == (b"GET", b"/x", b"b")
    assert split_host(head.get(b"host"), "localhost") == "web"
    assert split_host(b"a.b.localhost", "localhost") is None
    assert split_host(b"localhost", "localhost") is None


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET / HTTP/1.1\r\nbad\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nname : v\r\n\r\n", 400),
        (b"GET /\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
    ],
)
def test_malformed_heads_are_refused(data: bytes, status: int) -> None:
    with pytest.raises(HttpError) as caught:
        parse_request(data)
    assert caught.value.status == status


@pytest.mark.parametrize(
    "data",
    [
        b"POST / HTTP/1.1\r\nHost: a\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\ntransfer-encoding: xchunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nX-A: b\ntransfer-encoding: chunked\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close, Content-Length\r\n\r\n",
    ],
)
def test_framing_that_could_smuggle_a_request_is_refused(data: bytes) -> None:
    with pytest.raises(HttpError) as caught:
        parse_request(data)
    assert caught.value.status == 400


def test_a_chunked_request_and_an_absolute_target() -> None:
    chunked = parse_request(b"post / HTTP/1.1\r\nHost: a\r\ntransfer-encoding: chunked\r\n\r\n")
    assert chunked.framing.chunked and chunked.head.first == b"post"
    absolute = parse_request(b"GET http://web.localhost:8080/p?q HTTP/1.1\r\nHost: other.localhost\r\n\r\n")
    assert (absolute.authority, absolute.absolute, origin_form(absolute.head.target)) == (
        b"web.localhost:8080",
        True,
        b"/p?q",
    )
    assert origin_form(b"http://web.localhost") == b"/"


def test_a_deadline_cancels_only_its_own_wait_and_the_task_goes_on() -> None:
    import asyncio

    from orchestrator.proxy.deadlines import Deadlines

    now = [0.0]
    deadlines = Deadlines(lambda: now[0], every=3600)  # swept by hand below

    async def handler(outcomes: list[str]) -> None:
        watch = deadlines.watch()
        for timeout in (5.0, 5.0):
            watch.arm(timeout)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not watch.expired():
                    outcomes.append("cancelled")
                    raise
                outcomes.append("timed out")
            finally:
                watch.disarm()
        await asyncio.sleep(0)  # the task is not left cancelling: it awaits again
        outcomes.append("went on")
        deadlines.forget(watch)

    async def main() -> tuple[list[str], list[str]]:
        first: list[str] = []
        task = asyncio.create_task(handler(first))
        await asyncio.sleep(0)  # (each sleep(0) here: one turn of the loop, for the handler to run to its await)
        deadlines.sweep()  # not yet due
        await asyncio.sleep(0)  # one turn of the loop
        assert first == []
        now[0] = 5.0
        deadlines.sweep()
        await asyncio.sleep(0)  # one turn of the loop
        assert first == ["timed out"]
        now[0] = 10.0
        deadlines.sweep()
        await task
        second: list[str] = []
        other = asyncio.create_task(handler(second))
        await asyncio.sleep(0)  # one turn of the loop
        other.cancel()  # a cancellation that is not a deadline's stays one
        with pytest.raises(asyncio.CancelledError):
            await other
        await deadlines.close()
        return first, second

    assert asyncio.run(main()) == (["timed out", "timed out", "went on"], ["cancelled"])


@pytest.mark.parametrize(
    "body",
    [
        b"-1\r\nhello",
        b"0x5\r\nhello\r\n0\r\n\r\n",
        b"5;a\nb\r\nhello\r\n0\r\n\r\n",
        b"0\r\nX: a\nb\r\n\r\n",
        b"5\r\nhelloXX",
    ],
)
def test_a_machines_malformed_chunked_response_is_a_502(body: bytes) -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(body)
        reader.feed_eof()
        sink = _Sink()
        await copy_chunked(reader, sink)  # type: ignore[arg-type]

    with pytest.raises(HttpError) as caught:
        asyncio.run(main())
    assert caught.value.status == 502


def test_a_machines_response_head_with_a_bare_lf_is_a_502() -> None:
    with pytest.raises(HttpError) as caught:
        parse_response_head(b"HTTP/1.1 200 OK\r\nx-a: a\nx-b: b\r\n\r\n")
    assert caught.value.status == 502
    assert parse_response_head(b"HTTP/1.1 200 OK\r\nx-a: a\r\n\r\n").get(b"x-a") == b"a"


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\nx(a: a\r\n\r\n",  # a name that is not a token
        b"HTTP/1.1 200 OK\r\nx-a : a\r\n\r\n",  # a space before the colon
        b"HTTP/1.1 200 OK\r\nx-a: a\r\n b\r\n\r\n",  # obs-fold
        b"HTTP/1.1 200 OK\r\nx-a: a\x00b\r\n\r\n",
        b"HTTP/1.1 200 O\x00K\r\n\r\n",  # a NUL in the reason, which llhttp lets through
        b"HTTP/1.1 200 O\rK\r\n\r\n",
        b"HTTP/2.0 200 OK\r\n\r\n",
        b"RTSP/1.0 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    ],
)
def test_a_machines_malformed_response_head_is_a_502_not_the_clients_400(data: bytes) -> None:
    with pytest.raises(HttpError) as caught:
        parse_response(data).framing(b"GET")
    assert caught.value.status == 502


def test_a_response_is_framed_as_before_the_parser_and_its_fields_kept_in_order() -> None:
    response = parse_response(
        b"HTTP/1.1 200 OK\r\nX-B:  b \r\nContent-Length: 5\r\nConnection: Keep-Alive, X-B\r\n\r\n"
    )
    assert (response.status, response.reason, response.version) == (200, b"OK", b"HTTP/1.1")
    assert response.headers == [(b"x-b", b"b"), (b"content-length", b"5"), (b"connection", b"Keep-Alive, X-B")]
    assert response.connection == {b"keep-alive", b"x-b"}
    assert response.framing(b"GET") == (False, 5)
    assert response.framing(b"HEAD") == (False, 0)
    assert parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n").framing(b"GET") == (True, 0)
    assert parse_response(b"HTTP/1.0 200 OK\r\n\r\n").framing(b"GET") == (False, -1)  # until the machine closes
    assert parse_response(b"HTTP/1.1 204 No Content\r\n\r\n").framing(b"GET") == (False, 0)
    with pytest.raises(HttpError):
        parse_response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n").framing(b"GET")


def test_the_request_counts_and_latency_read_as_prometheus_clients_own_would() -> None:
    """`Served` counts in plain dicts; its exposition is the one a Counter and a Histogram give (less `_created`)."""
    metrics = ProxyMetrics()
    registry = CollectorRegistry()
    requests = Counter("fauxmad_proxy_requests", Served.REQUESTS[1], ["app", "region", "status"], registry=registry)
    latency = Histogram("fauxmad_proxy_request_seconds", Served.LATENCY[1], ["app"], buckets=BUCKETS, registry=registry)
    draw = random.Random(7)
    for _ in range(500):
        app, region, status = draw.choice(["web", "api"]), draw.choice(["mad", ""]), draw.choice([200, 404, 502])
        seconds = draw.choice([0.0005, 0.001, 10.0, 11.0, draw.random() / 10])  # bounds themselves, and beyond
        metrics.observe(app, region, status, seconds)
        requests.labels(app, region, str(status)).inc()
        latency.labels(app).observe(seconds)

    def lines(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "_created" not in line]

    ours = [line for line in lines(metrics.render()) if "fauxmad_proxy_request" in line]
    assert ours == lines(generate_latest(registry))
    assert len(ours) >= 50  # 12 counts, 2 apps x 17 histogram lines, 4 HELP and TYPE


class _Sink:
    def __init__(self) -> None:
        self.transport = self

    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    async def drain(self) -> None:
        return None


def test_a_refusal_by_a_machine_that_just_started_is_not_avoided_or_reported() -> None:
    """A process binds its port a moment after its worker says `started`: within `ready_timeout` of when this proxy
    saw it start, its refusal sends the request elsewhere and nothing more. Later (or a failure that is not a
    refusal) it is avoided for `avoid_for` and reported to the reconcilers, once."""
    from bus.contract.machines import MachineIndexEntry
    from orchestrator.apps.http_service import HttpService
    from orchestrator.proxy.config import ProxyConfig
    from orchestrator.proxy.failover import Failover
    from orchestrator.proxy.routes import App, RouteTable
    from orchestrator.proxy.upstream import Pool

    now = [100.0]
    routes = RouteTable(clock=lambda: now[0])
    published: list[str] = []
    config = ProxyConfig(region="mad")
    failover = Failover(
        config, routes, Pool(), ProxyMetrics(), lambda subject, data: published.append(subject), lambda: now[0]
    )
    app = App(name="web", service=HttpService())

    def entry(machine_id: str, state: str, version: int) -> MachineIndexEntry:
        return MachineIndexEntry(
            id=machine_id, worker_id="w1", region="mad", app="web", state=state, version=version, port=8080
        )

    routes.remember(entry("m0", "started", 1))  # first seen started (this proxy just began): not known when
    failover.failed(app, "m0", "refused", refused=True)
    assert failover.avoided() == {"m0"} and len(published) == 1
    now[0] += config.avoid_for
    published.clear()
    routes.remember(entry("m1", "starting", 1))
    routes.remember(entry("m1", "started", 2))
    now[0] += config.ready_timeout - 0.5
    failover.failed(app, "m1", "refused", refused=True)
    assert failover.avoided() == set() and published == []
    failover.failed(app, "m1", "closed the connection")  # not a refusal: avoided and reported
    assert failover.avoided() == {"m1"} and len(published) == 1
    now[0] += config.avoid_for
    assert failover.avoided() == set()
    routes.remember(entry("m1", "started", 3))  # still started: its start is not seen again
    now[0] += 1.0
    failover.failed(app, "m1", "refused", refused=True)
    assert failover.avoided() == {"m1"} and len(published) == 2
    now[0] += config.avoid_for
    assert failover.avoided() == set()
    routes.remember(entry("m1", "stopped", 4))
    routes.remember(entry("m1", "started", 5))  # started again: a new start
    failover.failed(app, "m1", "refused", refused=True)
    assert failover.avoided() == set() and len(published) == 2
    routes.bound("m1")  # it accepted a connection since: a refusal now is a dead machine's
    failover.failed(app, "m1", "refused", refused=True)
    assert failover.avoided() == {"m1"} and len(published) == 3


def test_a_jobs_machine_and_a_cordoned_one_are_not_the_apps_to_route_to() -> None:
    """A job's machine (`JOB_LABEL`) runs one attempt of a job of the app: no request goes to it, and the edge
    neither starts nor stops it (CI117: the operator, which counted it as the app's, destroyed it)."""
    from bus.contract.machines import CORDONED_LABEL, JOB_LABEL, MachineIndexEntry
    from tests.orchestrator.placement.test_placement import registry_of

    routes = RouteTable(registry=registry_of(1, lambda: 100.0, region="mad"))

    def entry(machine_id: str, labels: dict[str, str]) -> MachineIndexEntry:
        return MachineIndexEntry(
            id=machine_id, worker_id="w0", region="mad", app="web", state="started", port=8080, metadata=labels
        )

    routes.remember(entry("m1", {}))
    routes.remember(entry("job", {JOB_LABEL: "j1"}))
    routes.remember(entry("off", {CORDONED_LABEL: "true"}))
    assert [m.id for m in routes.machines("web")] == ["m1"]
