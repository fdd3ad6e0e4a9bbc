"""Issue 9: a barrage of hostile payloads over every API and worker subject changes nothing and stops no one.

Over 3,000 generated bad requests (random bytes, truncated JSON, wrong types, 1 MB strings, 10,000-deep
nesting, invalid UTF-8, lone surrogates, unknown fields, huge and negative numbers, NaN, odd subject
tokens, and well-typed requests that mean nothing: unknown ids, unknown signals, a foreign app) go raw
over a real nats-server to real worker and broker processes, 32 in flight. Every one must get a 4xx
reply in the contract's shape: never a 500, never a timeout, never "no responders". Afterwards every
process still answers and still beats, and nothing changed: the machines on every worker, the routing
index (KV `fauxmad_machines`), the events stream, the idempotency claims and each worker's log
sequence (unchanged, so not one write happened).

Generation is deterministic (`random.Random` seeded per request). Each generated payload is checked
locally against the request type of its subject with plain msgspec (strict UTF-8 first) and replaced
if it would be valid: a valid `cordon`, `reserve` or `create` would change state, which is not what
this test is about. Odd tokens go where a wildcard subscription receives them (the app of
`api.apps.*.machines.*`, the verb of `worker.<id>.machines.*` and of the API): a worker id or a region
no one serves is answered by NATS itself ("no responders", the transport's 404), so it is not sent.
`-` and `_` are legal app tokens (`bus.contract.subjects.check_token`): there, only invalid payloads are sent.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import string
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import nats

from bus.contract import subjects
from bus.contract.fleet import (
    CordonRequest,
    CreateRequest,
    InfoRequest,
    RegionsListRequest,
    SimulateRequest,
    WorkersListRequest,
)
from bus.contract.machines import (
    DestroyRequest,
    ExecRequest,
    GetRequest,
    LeaseRequest,
    ListRequest,
    MachineConfig,
    ReleaseRequest,
    ReserveRequest,
    ResumeRequest,
    SignalRequest,
    StartRequest,
    StopRequest,
    SuspendRequest,
    UpdateRequest,
    WaitRequest,
)
from bus.contract.offers import OfferRequest
from bus.contract.verbs import API_REQUESTS, BROKER_REQUESTS, WORKER_REQUESTS
from bus.stores.kv_keys import kv_keys
from bus.transport.service import ERROR_CODE_HEADER, ERROR_HEADER
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, connect_nats, fleet_fixture, until

SEED = 9
REGIONS = ["fza", "fzb"]
APP = "fz"
IDEMPOTENCY_KEY = "fuzz-key-1"
IN_FLIGHT = 32
TIMEOUT = 5.0
PER_TARGET = 62  # generated payloads per (subject, request type); the odd-subject and semantic sets come on top
MB_STRING = "x" * 1_000_000  # 1 MB: the payload around it still fits the server's default max_payload (1 MiB)
DEEP = 10_000

KIND_OF_VERB: dict[str, type[Any]] = WORKER_REQUESTS | BROKER_REQUESTS
WORKER_KINDS: dict[str, type[Any]] = dict(WORKER_REQUESTS)
API_KINDS: dict[str, type[Any]] = dict(API_REQUESTS)
EMPTY_OK = {ListRequest, InfoRequest, CordonRequest, WorkersListRequest, RegionsListRequest}

# signal names a worker must refuse (400) before it touches a machine: unknown names, numbers out of
# range, digits that are not ASCII ('²' is a digit to str.isdigit but not to int(); '٣' is 3 to int()),
# more digits than int() converts
BAD_SIGNALS = [
    "SIGFOO",
    "0",
    "65",
    "-1",
    "²",
    "\u0663",
    "9" * 5000,
    "",
    " ",
    "SIG",
    "SIG_DFL",
    "SIGRTMAX+1",
    "\x00",
    "1e3",
    "0x9",
    "+9",
    "KILL9",
    "x" * 100_000,
]
ODD_APPS = ["%", "ü", "a" * 65, "é", "$", "a+b", "#", "~", "ab%cd", "日本", "x" * 300]
NEEDS: dict[str, dict[str, Any]] = {
    "signal": {"signal": "SIGTERM"},
    "release": {"nonce": "n"},
    "update": {"config": {"cmd": ["true"]}},
    "exec": {"cmd": ["true"]},
}  # required fields besides `id`
ODD_VERBS = ["explode", "CREATE", "Get", "ü", "%", "list2", "x" * 70]


# ---------------------------------------------------------------------------------------------------
# payloads


def config() -> dict[str, Any]:
    return {
        "image": "img",
        "cmd": ["sleep", "1"],
        "env": {"A": "b"},
        "guest": {"cpus": 1, "memory_mb": 256, "cpu_kind": "shared"},
        "restart": {"policy": "no", "max_retries": 1},
        "checks": {"c": {"type": "tcp", "port": 80, "path": "/", "interval": 1.0, "timeout": 1.0, "grace_period": 0.0}},
        "metadata": {"k": "v"},
        "standbys": ["0123456789abcd"],
        "auto_destroy": False,
        "mounts": [{"volume": "vol_0123456789abcdef", "path": "/p"}],
    }


def template(kind: type[Any], machine_id: str, region: str) -> dict[str, Any]:
    """A valid request of `kind`, every optional field filled in, for the generators to spoil."""
    by_kind: dict[type[Any], dict[str, Any]] = {
        ReserveRequest: {
            "app": APP,
            "region": region,
            "config": config(),
            "name": "fz-1",
            "idempotency_key": "k",
            "id": "0123456789abcd",
            "launch": False,
            "expires_at": 1.0,
            "placement": {"chosen": "w"},
        },
        StartRequest: {"id": machine_id, "lease_nonce": "n"},
        StopRequest: {"id": machine_id, "signal": "SIGTERM", "timeout": 1.0, "lease_nonce": "n"},
        DestroyRequest: {"id": machine_id, "force": True, "lease_nonce": "n"},
        GetRequest: {"id": machine_id, "events": True},
        ListRequest: {"app": APP, "state": "started", "include_destroyed": True},
        WaitRequest: {"id": machine_id, "state": "started", "timeout": 1.0},
        SignalRequest: {"id": machine_id, "signal": "SIGTERM", "lease_nonce": "n"},
        LeaseRequest: {"id": machine_id, "ttl": 30.0, "holder": "h", "nonce": "n"},
        ReleaseRequest: {"id": machine_id, "nonce": "n"},
        UpdateRequest: {"id": machine_id, "config": config(), "lease_nonce": "n", "timeout": 1.0},
        ExecRequest: {"id": machine_id, "cmd": ["true"], "timeout": 1.0},
        SuspendRequest: {"id": machine_id, "lease_nonce": "n"},
        ResumeRequest: {"id": machine_id, "lease_nonce": "n"},
        OfferRequest: {
            "app": APP,
            "region": region,
            "guest": {"cpus": 1, "memory_mb": 256, "cpu_kind": "shared"},
            "image": "i",
            "request_id": "r",
        },
        InfoRequest: {},
        CordonRequest: {"reason": "r"},
        CreateRequest: {
            "region": region,
            "config": config(),
            "name": "n",
            "skip_launch": True,
            "idempotency_key": IDEMPOTENCY_KEY,
            "explain": True,
            "strategy": "scatter",
            "avoid_workers": ["w"],
            "prefer_away": ["w"],
        },
        RegionsListRequest: {},
        WorkersListRequest: {"region": region},
        SimulateRequest: {
            "app": APP,
            "region": region,
            "guest": {"cpus": 1, "memory_mb": 256, "cpu_kind": "shared"},
            "image": "i",
            "strategy": "p2c",
        },
    }
    return by_kind[kind]


def is_valid(kind: type[Any] | None, data: bytes) -> bool:
    """Would a strict server accept `data` as `kind`? Plain msgspec, UTF-8 checked first (RFC 8259)."""
    if kind is None:
        return False  # an odd subject: nothing is valid there
    if not data and (kind in EMPTY_OK):
        return True
    try:
        data.decode("utf-8")
        msgspec.json.decode(data, type=kind)
    except Exception:
        return False
    return True


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value (objects and arrays, leaves and inner nodes) but the root."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield (*prefix, index)
            yield from paths(item, (*prefix, index))


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: replaced(doc[head], rest, value)}
    copy = list(doc)
    copy[head] = replaced(copy[head], rest, value)
    return copy


def placeholder_at(doc: dict[str, Any], rng: random.Random, marker: str) -> bytes:
    """`doc` encoded with `marker` (a string) at a random place: a field's value, or an extra key's value."""
    spots = list(paths(doc))
    if spots and rng.random() < 0.8:
        return msgspec.json.encode(replaced(doc, rng.choice(spots), marker))
    return msgspec.json.encode({**doc, rng.choice(["x", "config", "id", "zz"]) + "_": marker})


WRONG_VALUES: list[Any] = [
    None,
    0,
    -1,
    1.5,
    True,
    False,
    "",
    "str",
    [],
    [1, "a"],
    {},
    {"a": 1},
    "SIGTERM",
    "0123456789abcd",
    2**63,
    -(2**63) - 1,
    1e308,
]


def gen_random_bytes(rng: random.Random, doc: dict[str, Any]) -> bytes:
    if rng.random() < 0.5:
        return rng.randbytes(rng.randint(1, 600))
    alphabet = string.printable + '{}[]":,\\'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300))).encode()


def gen_truncated(rng: random.Random, doc: dict[str, Any]) -> bytes:
    data = msgspec.json.encode(doc)
    return data[: rng.randint(1, max(1, len(data) - 1))]


def gen_wrong_type(rng: random.Random, doc: dict[str, Any]) -> bytes:
    if not doc:
        return msgspec.json.encode(rng.choice([[], "x", 1, None, True, [doc]]))
    out: Any = doc
    for _ in range(rng.randint(1, 3)):
        spots = list(paths(out))
        if spots:
            out = replaced(out, rng.choice(spots), rng.choice(WRONG_VALUES))
    return msgspec.json.encode(out)


def gen_top_level(rng: random.Random, doc: dict[str, Any]) -> bytes:
    return rng.choice(
        [
            b"[]",
            b"null",
            b"true",
            b"0",
            b'"{}"',
            b"[{}]",
            msgspec.json.encode([doc]),
            msgspec.json.encode(msgspec.json.encode(doc).decode()),
            b"-",
            b"1e400",
            b"{}}",
            b"{,}",
            b"\xef\xbb\xbf{}",
            b" ",
            b"\x00",
            b"{'a': 1}",
            b"{/*c*/}",
            b'{"a":1,}',
        ]
    )


def gen_huge_string(rng: random.Random, doc: dict[str, Any]) -> bytes:
    if rng.random() < 0.2:
        return msgspec.json.encode({**doc, MB_STRING: 1})  # a 1 MB unknown field name
    return placeholder_at(doc, rng, MB_STRING)


def gen_deep(rng: random.Random, doc: dict[str, Any]) -> bytes:
    deep = b"[" * DEEP + b"]" * DEEP if rng.random() < 0.5 else b'{"a":' * DEEP + b"1" + b"}" * DEEP
    if rng.random() < 0.3:
        return deep if rng.random() < 0.7 else deep[: len(deep) // 2]
    return placeholder_at(doc, rng, "@@DEEP@@").replace(b'"@@DEEP@@"', deep)


BAD_TEXT = [
    b"\xff\xfe",
    b"\xed\xa0\x80",
    b"\xc0\xaf",
    b"\xf4\x90\x80\x80",
    b"abc\xe2\x82",
    b"\x80",
    b"\xfe\xff",
    b"\\ud800",
    b"\\udc00",
    b"\\ud800x",
    b"\\ud800\\u0041",
    b"\\udbff",
    b"a\x01b",
    b"\\x41",
    b"\\u12",
]


def gen_bad_text(rng: random.Random, doc: dict[str, Any]) -> bytes:
    bad = rng.choice(BAD_TEXT)
    if rng.random() < 0.15:
        return b'{"' + bad + b'": 1}'  # in a key
    return placeholder_at(doc, rng, "@@BAD@@").replace(b"@@BAD@@", bad)


def gen_unknown_field(rng: random.Random, doc: dict[str, Any]) -> bytes:
    name = rng.choice(
        [
            "cpuz",
            "ID",
            "Id",
            "app ",
            "__class__",
            "config.cmd",
            "idempotencyKey",
            "$where",
            "é",
            "\u0000",
            "\\u0069d",
            "lease-nonce",
        ]
    )
    spots = [p for p in paths(doc) if isinstance(dict_at(doc, p), dict)]
    if spots and rng.random() < 0.4:
        where = rng.choice(spots)
        return msgspec.json.encode(replaced(doc, where, {**dict_at(doc, where), name: 1}))
    return msgspec.json.encode({**doc, name: rng.choice(WRONG_VALUES)})


def dict_at(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


HUGE_NUMBERS = [
    b"1e400",
    b"-1e400",
    b"1E400",
    b"2e308",
    str(2**70).encode(),
    str(-(2**70)).encode(),
    b"9" * 400,
    b"-0.0e999999",
    b"NaN",
    b"nan",
    b"-NaN",
    b"Infinity",
    b"-Infinity",
    b"inf",
    b"0x10",
    b"1_000",
    b"01",
    b".5",
    b"5.",
    b"+1",
    b"-1",
    b"-0.001",
    b"-86400",
    b"-1e-300",
]


def gen_number(rng: random.Random, doc: dict[str, Any]) -> bytes:
    """Huge numbers, negative timeouts and ttls, NaN and friends, in place of any value."""
    number = rng.choice(HUGE_NUMBERS)
    numeric = [
        p for p in paths(doc) if isinstance(dict_at(doc, p), int | float) and not isinstance(dict_at(doc, p), bool)
    ]
    spots = numeric if numeric and rng.random() < 0.7 else list(paths(doc))
    if not spots:
        return b'{"timeout": ' + number + b"}"
    return msgspec.json.encode(replaced(doc, rng.choice(spots), "@@NUM@@")).replace(b'"@@NUM@@"', number)


GENERATORS: list[tuple[str, Callable[[random.Random, dict[str, Any]], bytes], int]] = [
    ("random-bytes", gen_random_bytes, 8),
    ("truncated-json", gen_truncated, 8),
    ("wrong-type", gen_wrong_type, 10),
    ("top-level", gen_top_level, 3),
    ("1mb-string", gen_huge_string, 2),
    ("deep-nesting", gen_deep, 3),
    ("invalid-utf8", gen_bad_text, 8),
    ("unknown-field", gen_unknown_field, 6),
    ("numbers", gen_number, 8),
]


def generate(rng: random.Random, kind: type[Any] | None, doc: dict[str, Any]) -> tuple[str, bytes]:
    """A payload `kind` must refuse; (family, bytes)."""
    names = [name for name, _, _ in GENERATORS]
    weights = [weight for _, _, weight in GENERATORS]
    fns = {name: fn for name, fn, _ in GENERATORS}
    for _ in range(50):
        family = rng.choices(names, weights)[0]
        data = fns[family](rng, doc)
        if not is_valid(kind, data):
            return family, data
    return "random-bytes", b"{\xff"


# ---------------------------------------------------------------------------------------------------
# the plan of requests


class Shot(msgspec.Struct, frozen=True):
    subject: str
    family: str  # the subject's family, for the figures
    make: Callable[[], tuple[str, bytes]]  # (what the payload is, its bytes), built when sent


def plan(worker_of: dict[str, str], region_of: dict[str, str], machines: dict[str, str]) -> list[Shot]:
    """Every request of the barrage, deterministic; payloads are built when sent (the 1 MB ones add up)."""
    rng = random.Random(SEED)
    real = [machines["started"], machines["reserved"], machines["keyed"]]
    shots: list[Shot] = []

    def generated(subject: str, family: str, kind: type[Any] | None, region: str, count: int) -> None:
        for _ in range(count):
            seed = rng.getrandbits(64)
            machine_id = rng.choice([*real, f"{rng.getrandbits(56):014x}"])
            doc = template(kind, machine_id, region) if kind is not None else {"id": machine_id}
            shots.append(Shot(subject, family, _maker(seed, kind, doc)))

    for worker, region in region_of.items():
        for verb, kind in WORKER_KINDS.items():
            generated(subjects.worker_machines(worker, verb), f"worker.machines.{verb}", kind, region, PER_TARGET)
        generated(subjects.worker_offer(worker), "worker.offer", OfferRequest, region, PER_TARGET)
        generated(subjects.worker_info(worker), "worker.info", InfoRequest, region, PER_TARGET)
        generated(subjects.worker_cordon(worker, True), "worker.cordon", CordonRequest, region, PER_TARGET)
        generated(subjects.worker_cordon(worker, False), "worker.uncordon", CordonRequest, region, PER_TARGET)
        generated(subjects.offers(region), "offers.<region>", OfferRequest, region, PER_TARGET)
    for verb, kind in API_KINDS.items():
        generated(subjects.api_machines(APP, verb), f"api.machines.{verb}", kind, REGIONS[0], PER_TARGET)
        # '-' and '_' are legal app tokens (an app with no machines): garbage there is a 400 all the same
        generated(f"{subjects.PREFIX}.api.apps.-.machines.{verb}", "api.machines (app '-')", kind, REGIONS[0], 4)
        generated(f"{subjects.PREFIX}.api.apps._.machines.{verb}", "api.machines (app '_')", kind, REGIONS[1], 2)
    generated(subjects.API_REGIONS_LIST, "api.regions.list", RegionsListRequest, REGIONS[0], PER_TARGET)
    generated(subjects.API_WORKERS_LIST, "api.workers.list", WorkersListRequest, REGIONS[0], PER_TARGET)
    generated(subjects.API_PLACEMENTS_SIMULATE, "api.placements.simulate", SimulateRequest, REGIONS[0], PER_TARGET)

    shots += odd_subjects(rng, region_of, real)
    shots += semantic(worker_of, region_of, machines)
    return shots


def _maker(seed: int, kind: type[Any] | None, doc: dict[str, Any]) -> Callable[[], tuple[str, bytes]]:
    return lambda: generate(random.Random(seed), kind, doc)


def _fixed(data: bytes, what: str) -> Callable[[], tuple[str, bytes]]:
    return lambda: (what, data)


def _json(doc: Any, what: str) -> Callable[[], tuple[str, bytes]]:
    data = msgspec.json.encode(doc)
    return lambda: (what, data)


def odd_subjects(rng: random.Random, region_of: dict[str, str], real: list[str]) -> list[Shot]:
    """App tokens that cannot be apps and verbs no one serves: a 400 whatever the payload, even a valid one."""
    shots: list[Shot] = []
    for app in ODD_APPS:
        for verb, kind in API_KINDS.items():
            valid = template(kind, rng.choice(real), REGIONS[0])
            what, garbage = generate(random.Random(rng.getrandbits(64)), kind, valid)
            subject = f"{subjects.PREFIX}.api.apps.{app}.machines.{verb}"
            shots.append(Shot(subject, "odd-subject (api app)", _json(valid, "valid payload")))
            shots.append(Shot(subject, "odd-subject (api app)", _fixed(garbage, what)))
    payloads: list[Any] = [{}, b"", {"id": real[0]}, {"id": real[0], "force": True}, b"\xff", {"region": REGIONS[0]}]
    for verb in ODD_VERBS:
        for payload in payloads:
            make = _fixed(payload, "any payload") if isinstance(payload, bytes) else _json(payload, "any payload")
            shots.append(Shot(f"{subjects.PREFIX}.api.apps.{APP}.machines.{verb}", "odd-subject (api verb)", make))
            for worker in region_of:
                shots.append(Shot(subjects.worker_machines(worker, verb), "odd-subject (worker verb)", make))
    return shots


def semantic(worker_of: dict[str, str], region_of: dict[str, str], machines: dict[str, str]) -> list[Shot]:
    """Well-typed requests that mean nothing: unknown ids and signals, a foreign app, an illegal move."""
    started, reserved, keyed = machines["started"], machines["reserved"], machines["keyed"]
    rng = random.Random(SEED + 1)
    unknown = [f"{rng.getrandbits(56):014x}" for _ in range(4)]
    owner, other = worker_of[started], next(w for w in region_of if w != worker_of[started])
    shots: list[Shot] = []

    def worker_shot(worker: str, verb: str, doc: Any) -> None:
        shots.append(Shot(subjects.worker_machines(worker, verb), f"worker.machines.{verb}", _json(doc, "semantic")))

    def api_shot(verb: str, doc: Any, app: str = APP) -> None:
        shots.append(Shot(subjects.api_machines(app, verb), f"api.machines.{verb}", _json(doc, "semantic")))

    for bad, machine_id, verb in itertools.product(BAD_SIGNALS, (started, reserved, unknown[0]), ("stop", "signal")):
        worker_shot(worker_of.get(machine_id, owner), verb, {"id": machine_id, "signal": bad})  # unknown signal: 400
        if machine_id == started:
            api_shot(verb, {"id": started, "signal": bad})
    for machine_id, verb in itertools.product(unknown, WORKER_KINDS):
        if verb not in ("reserve", "list"):
            doc = {"id": machine_id, **NEEDS.get(verb, {})}
            api_shot(verb, doc)  # no such machine: 404
            for worker in region_of:
                worker_shot(worker, verb, doc)
    for machine_id, verb in itertools.product((started, reserved, keyed), ("get", "start", "stop", "destroy", "lease")):
        worker_shot(other if worker_of[machine_id] == owner else owner, verb, {"id": machine_id})  # elsewhere: 404
        api_shot(verb, {"id": machine_id}, app="other")  # not this app's machine: 404
    worker_shot(owner, "destroy", {"id": started})  # started, no force: 409
    api_shot("destroy", {"id": started})
    worker_shot(worker_of[reserved], "signal", {"id": reserved, "signal": "SIGTERM"})  # not started: 409
    api_shot("signal", {"id": reserved, "signal": "SIGTERM"})
    for worker, region in region_of.items():
        elsewhere = next(r for r in region_of.values() if r != region)
        worker_shot(worker, "reserve", {"app": APP, "region": elsewhere, "config": {"cmd": ["true"]}})
        worker_shot(worker, "reserve", {"app": APP, "region": region, "config": {"cmd": []}})
        worker_shot(worker, "reserve", {"app": APP, "region": region, "config": {}, "idempotency_key": IDEMPOTENCY_KEY})
    for machine_id in (started, reserved):
        worker_shot(worker_of[machine_id], "update", {"id": machine_id, "config": {"cmd": []}})
        api_shot("update", {"id": machine_id, "config": {"cmd": []}})
    for key in (IDEMPOTENCY_KEY, "fuzz-key-2"):
        api_shot("create", {"region": REGIONS[0], "config": {"cmd": []}, "idempotency_key": key})
    api_shot("create", {"region": REGIONS[0], "config": {}})
    api_shot("list", {"app": "other"})
    return shots


# ---------------------------------------------------------------------------------------------------
# the fleet, its state, the barrage


fleet = fleet_fixture(FleetSpec(regions=REGIONS, workers_per_region=1, brokers=2, cpus=8, memory_mb=8192))


async def bucket(js: Any, name: str) -> dict[str, Any]:
    """Every key of a KV bucket with its value and revision, and the bucket's stream position."""
    info = await js.stream_info(f"KV_{name}")
    kv = await js.key_value(name)
    entries = {}
    for key in await kv_keys(kv):  # from the stream: nats-py's keys() can miss keys on a loaded host
        entry = await kv.get(key)
        entries[key] = (entry.revision, entry.value)
    return {"last_seq": info.state.last_seq, "messages": info.state.messages, "entries": entries}


async def snapshot(nc: Any, workers: list[str]) -> dict[str, Any]:
    js = nc.jetstream()
    state: dict[str, Any] = {"workers": {}}
    for worker in workers:
        listed = await nc.request(subjects.worker_machines(worker, "list"), b'{"include_destroyed": true}', timeout=5)
        info = msgspec.json.decode((await nc.request(subjects.worker_info(worker), b"", timeout=5)).data)
        state["workers"][worker] = {
            "machines": msgspec.json.decode(listed.data),
            "log_seq": info["log_seq"],
            "cordoned": info["cordoned"],
            "used": info["used"],
        }
    state["index"] = await bucket(js, subjects.MACHINES_BUCKET)
    state["idempotency"] = await bucket(js, subjects.IDEMPOTENCY_BUCKET)
    events = await js.stream_info(subjects.EVENTS_STREAM)
    state["events"] = {"last_seq": events.state.last_seq, "messages": events.state.messages}
    return state


async def settled(nc: Any, workers: list[str]) -> dict[str, Any]:
    """The state once the outboxes have delivered the setup's last events (two equal snapshots in a row)."""
    previous = await snapshot(nc, workers)
    for _ in range(40):
        await asyncio.sleep(0.3)
        current = await snapshot(nc, workers)
        if current == previous:
            return current
        previous = current
    raise AssertionError("the fleet did not settle after the setup")


class Outcome(msgspec.Struct):
    shot: Shot
    what: str = ""
    code: int | None = None
    problem: str | None = None
    latency: float = 0.0
    size: int = 0


async def fire(nc: Any, shot: Shot) -> Outcome:
    what, data = shot.make()
    began = time.perf_counter()
    try:
        msg = await nc.request(shot.subject, data, timeout=TIMEOUT)
    except nats.errors.NoRespondersError:
        return Outcome(shot, what, problem="no responders", latency=time.perf_counter() - began)
    except nats.errors.TimeoutError:
        return Outcome(shot, what, problem=f"timeout after {TIMEOUT:g}s", latency=time.perf_counter() - began)
    latency = time.perf_counter() - began
    headers = msg.headers or {}
    raw_code = headers.get(ERROR_CODE_HEADER)
    if raw_code is None:
        return Outcome(shot, what, code=200, problem=f"success: {msg.data[:200]!r}", latency=latency)
    code = int(raw_code)
    problem = None
    try:
        body = msgspec.json.decode(msg.data)
        error = body["error"]
        if set(body) != {"error"} or error["code"] != code or not isinstance(error["message"], str):
            problem = f"bad error body {msg.data[:200]!r}"
    except Exception:
        problem = f"error body is not JSON: {msg.data[:200]!r}"
    if not 400 <= code <= 499:
        problem = f"{code}: {headers.get(ERROR_HEADER, '')[:300]}"
    elif not headers.get(ERROR_HEADER):
        problem = "no Nats-Service-Error header"
    elif len(msg.data) > 4096:
        problem = f"error reply of {len(msg.data)} bytes"
    return Outcome(shot, what, code=code, problem=problem, latency=latency, size=len(data))


async def barrage(nc: Any, shots: list[Shot]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    queue = iter(shots)

    async def lane() -> None:
        for shot in queue:  # one shared iterator: IN_FLIGHT lanes, each one request at a time
            outcomes.append(await fire(nc, shot))

    await asyncio.gather(*[lane() for _ in range(IN_FLIGHT)])
    return outcomes


def describe(outcome: Outcome) -> str:
    payload = outcome.shot.make()[1]
    return f"{outcome.shot.subject[:90]} [{outcome.what}] {payload[:100]!r}: {outcome.problem}"


def test_a_barrage_of_bad_payloads_gets_4xx_everywhere_and_changes_nothing(fleet: DevFleet) -> None:
    workers = list(fleet.worker_ids)
    region_of = {worker: worker.rsplit("-w", 1)[0] for worker in workers}

    async def main() -> None:
        client = await FleetClient.connect(fleet.url, "fuzz-setup")
        nc = await connect_nats(fleet.url, name="fuzz", max_reconnect_attempts=0)
        try:
            sleeper = MachineConfig(cmd=["sleep", "600"])
            started = await client.create(APP, CreateRequest(region=REGIONS[0], config=sleeper))
            reserved = await client.create(APP, CreateRequest(region=REGIONS[1], config=sleeper, skip_launch=True))
            keyed = await client.create(
                APP, CreateRequest(region=REGIONS[0], config=sleeper, skip_launch=True, idempotency_key=IDEMPOTENCY_KEY)
            )
            assert (started.state, reserved.state, keyed.state) == ("started", "created", "created")
            machines = {"started": started.id, "reserved": reserved.id, "keyed": keyed.id}
            worker_of = {m.id: m.worker_id for m in (started, reserved, keyed)}
            before = await settled(nc, workers)
            assert len(before["index"]["entries"]) == 3 and len(before["idempotency"]["entries"]) == 1

            shots = plan(worker_of, region_of, machines)
            began = time.perf_counter()
            outcomes = await barrage(nc, shots)
            wall = time.perf_counter() - began

            # figures first (pytest -s shows them), then the verdict
            per_family: Counter[str] = Counter(o.shot.family for o in outcomes)
            worst: dict[str, float] = defaultdict(float)
            for o in outcomes:
                worst[o.shot.family] = max(worst[o.shot.family], o.latency)
            slowest = max(outcomes, key=lambda o: o.latency)
            codes = Counter(o.code for o in outcomes)
            print(
                f"\nfuzz: {len(outcomes)} requests in {wall:.1f}s ({len(outcomes) / wall:.0f}/s, {IN_FLIGHT} in "
                f"flight), replies by code {dict(sorted(codes.items(), key=lambda kv: kv[0] or 0))}"
            )
            print(
                f"fuzz: payloads by kind {dict(sorted(Counter(o.what for o in outcomes).items()))}, "
                f"{sum(o.size for o in outcomes) / 1e6:.0f} MB sent, {sum(o.size >= 1_000_000 for o in outcomes)} of 1 MB"
            )
            print(f"fuzz: worst latency {slowest.latency * 1000:.0f} ms on {slowest.shot.subject[:80]}")
            for family, count in sorted(per_family.items()):
                print(f"  {family:32} {count:5}  worst {worst[family] * 1000:6.0f} ms")

            failures = [o for o in outcomes if o.problem is not None]
            assert len(outcomes) == len(shots) >= 3000
            assert not failures, f"{len(failures)} bad replies:\n" + "\n".join(describe(o) for o in failures[:25])

            # everyone still answers, and beats
            for worker in workers:
                info = msgspec.json.decode((await nc.request(subjects.worker_info(worker), b"", timeout=2)).data)
                assert info["worker_id"] == worker
            listed = msgspec.json.decode((await nc.request(subjects.API_WORKERS_LIST, b"", timeout=2)).data)
            assert sorted(w["worker_id"] for w in listed) == sorted(workers)
            regions = msgspec.json.decode((await nc.request(subjects.API_REGIONS_LIST, b"{}", timeout=2)).data)
            assert sorted(r["region"] for r in regions) == REGIONS
            inbox = nc.new_inbox()
            pongs = await nc.subscribe(inbox)
            for service in (subjects.BROKER_SERVICE, subjects.WORKER_SERVICE):
                await nc.publish(f"$SRV.PING.{service}", b"", reply=inbox)
            answered: list[str] = []
            for _ in range(len(workers) + fleet.spec.brokers):
                answered.append(msgspec.json.decode((await pongs.next_msg(timeout=2)).data)["name"])
            assert Counter(answered) == {
                subjects.BROKER_SERVICE: fleet.spec.brokers,
                subjects.WORKER_SERVICE: len(workers),
            }
            beats = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
            revisions = {w: (await beats.get(subjects.worker_key(region_of[w], w))).revision for w in workers}

            async def all_beat_again() -> bool:
                for worker in workers:
                    if (await beats.get(subjects.worker_key(region_of[worker], worker))).revision <= revisions[worker]:
                        return False
                return True

            await until(all_beat_again, "every worker's next heartbeat (all still beating)", 10)
            assert all(proc.poll() is None for _, proc in fleet.processes)

            # and nothing changed: machines, index, events, claims, log sequences
            after = await snapshot(nc, workers)
            for part in ("workers", "index", "idempotency", "events"):
                assert after[part] == before[part], part
        finally:
            await nc.close()
            await client.close()

    arun(main())


def test_the_generators_spoil_valid_templates_deterministically() -> None:
    """No fleet: every template is valid for its type, every generated payload is not, and a seed is a payload."""
    kinds: set[type[Any]] = {
        *KIND_OF_VERB.values(),
        OfferRequest,
        InfoRequest,
        CordonRequest,
        RegionsListRequest,
        WorkersListRequest,
        SimulateRequest,
    }
    for kind in kinds:
        doc = template(kind, "0123456789abcd", REGIONS[0])
        assert is_valid(kind, msgspec.json.encode(doc)), kind
        for seed in range(40):
            what, data = generate(random.Random(seed), kind, doc)
            assert not is_valid(kind, data), (kind, what, data[:200])
            assert generate(random.Random(seed), kind, doc) == (what, data)
