"""The roles table (orchestrator/security/roles.py) against the whole contract, on a real nats-server.

Why generated: the permission table in docs/how-to/secure-fleet.md is a hand-picked excerpt (test_security_matrix
walks it); this walks every subject family of the contract (`bus.contract.schema.channels`, what the AsyncAPI
document lists), each bound to its own and to someone else's worker, region and app, for every role, and publishes,
subscribes and (where the family is a request) requests. What `roles.permissions` allows must work; what it does not
must be refused by nats-server. Anything else is a surprise, and so is a family that no role but the operator may
use at all unless `OPERATOR_ONLY` says why (the table forgot it), or one listed there that a role does use.

Evidence, never silence: a refusal is the server's permissions violation (nats-py's error callback; for a request,
the 403 `Forbidden` of the project's `Connection`), an arrival is an arrival; neither within the bound is a
surprise. A subscription's flush (PONG) does not mean another connection's publishes see it yet (nats-server
v2.15.1 loses a few percent of messages published from another connection right after subscribe + flush), so
every subscription a verdict depends on is probed until it is seen receiving: the spy (the operator on `>`) and
the answerers before any check, each checked subscription by an operator publishing a probe on its exact subject
until it arrives (or the server's refusal is in), and each requester's inbox by a request answered before its
checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from typing import Literal, NamedTuple

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.contract import subjects
from bus.contract.errors import Forbidden
from bus.contract.schema import Channel, channels
from bus.local.embedded import find_binary
from bus.local.ports import free_port
from bus.transport.connection import connect
from orchestrator.security.fleetdir import FleetDir
from orchestrator.security.roles import Identity, Permissions, Role, permissions
from tests.helpers import arun
from tests.orchestrator.security.test_security_matrix import _connect, _wait_listening

Mode = Literal["pub", "sub", "req"]

# each role's identity in this fleet, and the values a family's parameters take: the identity's own, another's
NAMES: dict[Role, str] = {
    "worker": "worker-mad-w1",
    "broker": "broker-1",
    "api": "api-1",
    "proxy": "proxy-1",
    "operator": "operator",
    "deployer": "ci-web",
    "viewer": "ops-bob",
}
VALUES = {
    "worker_id": ("mad-w1", "syd-w9"),
    "region": ("mad", "syd"),
    "app": ("web", "other"),
    "machine_id": ("m1",),
    "job_id": ("j1",),
    "broker": ("b1",),
    "upload": ("u1",),
}
# families no role but the operator uses, on purpose: each with who uses it, so a new family is a decision (none
# today: the edge's two, `proxy_unreachable` and `proxy_activity`, are the proxy role's since it exists)
OPERATOR_ONLY: dict[str, str] = {}
BOUND = 3.0  # seconds for an arrival, a refusal or an answer: anything slower is a surprise, never a verdict
LOOK = 0.02  # after a refusal, how long to look for something it should have kept from arriving
PARALLEL = 64


class Check(NamedTuple):
    role: Role
    mode: Mode
    subject: str
    family: str
    expect: bool


def instances(address: str) -> list[str]:
    names = re.findall(r"\{(\w+)\}", address)
    return [
        address.format(**dict(zip(names, combo, strict=True)))
        for combo in itertools.product(*(VALUES[n] for n in names))
    ]


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(subjects.matches(pattern, subject) for pattern in patterns)


def expectations(families: list[Channel], table: dict[Role, Permissions]) -> list[Check]:
    """Every role x every instance of every family x publish, subscribe and (for a request family) request."""
    checks = []
    for role, perms in table.items():
        for family in families:
            modes: tuple[Mode, ...] = ("pub", "sub", "req") if family.reply is not None else ("pub", "sub")
            for subject in instances(family.address):
                for mode in modes:
                    patterns = perms.subscribe if mode == "sub" else perms.publish
                    checks.append(Check(role, mode, subject, family.name, allowed(patterns, subject)))
    return checks


def forgotten(families: list[Channel], checks: list[Check], operator_only: dict[str, str] = OPERATOR_ONLY) -> list[str]:
    """Families the table forgot (no role but the operator may use them, and `operator_only` does not say why),
    and families `operator_only` lists that a role does use (the listing is stale)."""
    used = {check.family for check in checks if check.expect and check.role != "operator"}
    names = {family.name for family in families}
    return [
        f"family {name}: no role but the operator may use it (the table forgot it)"
        for name in sorted(names - used - set(operator_only))
    ] + [
        f"family {name}: listed as operator-only, yet a role may use it"
        for name in sorted(names & used & set(operator_only))
    ]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetDir, str]]:
    root = tmp_path_factory.mktemp("role-table")
    port = free_port()
    fleet = FleetDir(root / "fleet")
    fleet.init(port=port)
    fleet.add_worker("mad-w1", "mad")
    fleet.add_user("broker-1", "broker")
    fleet.add_user("api-1", "api")
    fleet.add_user("proxy-1", "proxy")
    fleet.add_user("ci-web", "deployer", app="web")
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


async def _until(done: Callable[[], bool], seconds: float, step: Callable[[], Awaitable[None]] | None = None) -> bool:
    """Whether `done()` became true within `seconds`, running `step` (a probe) between looks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not done():
        if loop.time() >= deadline:
            return False
        if step is not None:
            await step()
        await asyncio.sleep(0.002)
    return True


class Watched:
    """A connection whose permissions violations (nats-py's error callback) are kept, in lower case."""

    def __init__(self, nc: Client, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors

    def refused(self, kind: Literal["publish", "subscription"], subject: str) -> bool:
        said = f'permissions violation for {kind} to "{subject.lower()}"'
        return any(said in error.lower() for error in self.errors)


async def _watched(fleet: FleetDir, url: str, name: str) -> Watched:
    errors: list[str] = []
    return Watched(await _connect(fleet, url, name, errors), errors)


class Operator:
    """The operator's side: a spy on `>` (what really went through), a prober, and answerers for request subjects."""

    def __init__(self, spy: Client, prober: Client, answerer: Client) -> None:
        self.spy, self.prober, self.answerer = spy, prober, answerer
        self.seen: set[tuple[str, bytes]] = set()

    async def start(self, request_subjects: set[str]) -> None:
        async def record(msg: Msg) -> None:
            self.seen.add((msg.subject, msg.data))

        async def answer(msg: Msg) -> None:
            if msg.reply:
                await msg.respond(b"answered " + msg.data)

        await self.spy.subscribe(">", cb=record)
        await self.spy.flush()
        probe = ("fauxmad.v1.role-table.spy", b"probe")
        assert await _until(lambda: probe in self.seen, BOUND, lambda: self.prober.publish(*probe)), "spy deaf"
        for subject in request_subjects:
            await self.answerer.subscribe(subject, cb=answer)
        await self.answerer.flush()
        answered = await asyncio.gather(*(self._answered(subject) for subject in request_subjects))
        assert all(answered), [s for s, ok in zip(request_subjects, answered, strict=True) if not ok]

    async def _answered(self, subject: str) -> bool:
        """Whether the answerer of `subject` answers the prober's request (asked until it does, within BOUND)."""
        replies: list[bytes] = []

        async def ask() -> None:
            with contextlib.suppress(nats.errors.TimeoutError):
                replies.append((await self.prober.request(subject, b"probe", timeout=0.05)).data)

        return await _until(lambda: bool(replies), BOUND, ask)

    def arrived(self, subject: str, token: bytes) -> bool:
        return (subject, token) in self.seen


async def _publish(me: Watched, operator: Operator, subject: str, token: bytes) -> str:
    def arrived() -> bool:
        return operator.arrived(subject, token)

    def refused() -> bool:
        return me.refused("publish", subject)

    await me.nc.publish(subject, token)
    await me.nc.flush()
    if not await _until(lambda: arrived() or refused(), BOUND):
        return f"neither delivered nor refused within {BOUND} s"
    await _until(arrived, LOOK)  # a refused publish is looked for a moment all the same
    return _verdict(arrived(), refused(), "delivered")


def _verdict(arrived: bool, refused: bool, what: str) -> str:
    if refused:
        return f"refused, yet {what}" if arrived else "refused"
    return "ok"


async def _subscribe(me: Watched, operator: Operator, subject: str, token: bytes) -> str:
    got: list[bytes] = []

    async def collect(msg: Msg) -> None:
        got.append(msg.data)

    async def probe() -> None:
        await operator.prober.publish(subject, token)
        await operator.prober.flush()

    def refused() -> bool:
        return me.refused("subscription", subject)

    sub = await me.nc.subscribe(subject, cb=collect)
    await me.nc.flush()
    try:
        # probed until the subscription is seen receiving (a flush alone does not make it visible to other
        # connections) or the server's refusal is in
        if not await _until(lambda: bool(got) or refused(), BOUND, probe):
            return f"neither received nor refused within {BOUND} s"
        if refused():  # and a refused one is probed all the same
            await probe()
            await _until(lambda: bool(got), LOOK)
        return _verdict(bool(got), refused(), "received")
    finally:
        await sub.unsubscribe()


async def _request(me: Client, operator: Operator, subject: str, token: bytes) -> str:
    try:
        reply = await me.request(subject, token, timeout=BOUND)
    except Forbidden:  # the server's refusal of the request's publish (our Connection), at once
        await _until(lambda: operator.arrived(subject, token), LOOK)
        return _verdict(operator.arrived(subject, token), True, "delivered")
    except nats.errors.TimeoutError:
        return f"neither answered nor refused within {BOUND} s"
    return "ok" if reply.data == b"answered " + token else f"answered {reply.data!r}"


async def _requester(fleet: FleetDir, url: str, name: str) -> Client:
    """The project's secure connection (a refused request is `Forbidden` at once), its inbox seen answered first:
    `$JS.API.INFO`, which every role may ask, asked until the server's answer reaches the inbox."""
    nc = await connect(url, f"role-table-{name}", creds=str(fleet.creds(name)), timeout=5)
    answers: list[Msg] = []

    async def ask() -> None:
        with contextlib.suppress(nats.errors.TimeoutError):
            answers.append(await nc.request("$JS.API.INFO", b"", timeout=0.1))

    assert await _until(lambda: bool(answers), BOUND, ask), f"{name}'s inbox never answered"
    return nc


async def walk(fleet: FleetDir, url: str, checks: list[Check]) -> tuple[int, int, list[str]]:
    """Run `checks` (concurrently, each on its own subject or token): the allowed that worked, the forbidden that
    the server refused, and the surprises."""
    operator = Operator(*[await _connect(fleet, url, "operator", []) for _ in range(3)])
    clients: list[Client] = [operator.spy, operator.prober, operator.answerer]
    try:
        await operator.start({check.subject for check in checks if check.mode == "req"})
        publishers: dict[Role, Watched] = {}
        subscribers: dict[Role, Watched] = {}
        requesters: dict[Role, Client] = {}
        for role in {check.role for check in checks}:
            publishers[role] = await _watched(fleet, url, NAMES[role])
            subscribers[role] = await _watched(fleet, url, NAMES[role])
            requesters[role] = await _requester(fleet, url, NAMES[role])
            clients += [publishers[role].nc, subscribers[role].nc, requesters[role]]
        gate = asyncio.Semaphore(PARALLEL)

        async def run(n: int, check: Check) -> str:
            token = f"role-table {n} {check.role} {check.mode}".encode()
            async with gate:
                if check.mode == "pub":
                    return await _publish(publishers[check.role], operator, check.subject, token)
                if check.mode == "sub":
                    return await _subscribe(subscribers[check.role], operator, check.subject, token)
                return await _request(requesters[check.role], operator, check.subject, token)

        outcomes = await asyncio.gather(*(run(n, check) for n, check in enumerate(checks)))
    finally:
        for client in clients:
            await client.close()
    checked = refused = 0
    surprises = []
    for check, outcome in zip(checks, outcomes, strict=True):
        wanted = "ok" if check.expect else "refused"
        if outcome != wanted:
            surprises.append(f"{check.role} {check.mode} {check.subject}: expected {wanted}, got {outcome}")
        elif check.expect:
            checked += 1
        else:
            refused += 1
    return checked, refused, surprises


def test_every_role_against_every_family_of_the_contract(
    fleet: tuple[FleetDir, str], capsys: pytest.CaptureFixture[str]
) -> None:
    directory, url = fleet
    identities = {entry.identity.name: entry.identity for entry in directory.entries()}
    table = {role: permissions(identities[name]) for role, name in NAMES.items()}
    families = channels()
    assert len(families) >= 60 and set(OPERATOR_ONLY) <= {family.name for family in families}
    checks = expectations(families, table)
    checked, refused, surprises = arun(walk(directory, url, checks))
    surprises += forgotten(families, checks)
    with capsys.disabled():
        print(f"\n{checked} allowed checked, {refused} forbidden refused, {len(surprises)} surprises")
    assert not surprises, "\n".join(surprises[:50])
    assert checked > 100 and refused > 1000  # the walk covered the contract, not a handful of subjects


def test_a_family_the_table_forgot_is_a_surprise() -> None:
    """The check itself: a new family no role lists is reported, not passed over; so is a stale operator-only one."""
    worker = permissions(Identity(name="worker-mad-w1", role="worker", worker_id="mad-w1", region="mad"))
    nobody = Channel("forgotten", "fauxmad.v1.nobody.{app}", "a family no role lists", bytes)
    stale = Channel("proxy_activity", "fauxmad.v1.events.{region}.{worker_id}.{app}.{machine_id}", "", bytes)
    operator = Permissions(publish=(">",), subscribe=(">",))
    checks = expectations([nobody, stale], {"worker": worker, "operator": operator})
    assert forgotten([nobody, stale], checks, {"proxy_activity": "published by edge proxies only"}) == [
        "family forgotten: no role but the operator may use it (the table forgot it)",
        "family proxy_activity: listed as operator-only, yet a role may use it",
    ]
