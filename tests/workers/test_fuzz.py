"""Malformed and fuzzed payloads on every worker subject: a 400 every time, and the worker stays alive."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import nats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.contract.verbs import WORKER_REQUESTS
from tests.helpers import RawClient, WorkerProcess, arun

VERBS = list(WORKER_REQUESTS)
OTHER = ["info", "cordon", "uncordon"]

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

# payloads that can never be a valid request: not an object, not JSON, or an object with an unknown field
not_json = st.binary(min_size=1, max_size=64).filter(lambda b: not _is_json(b))
not_object = json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode())
unknown_field = st.dictionaries(
    st.sampled_from(["id", "app", "region", "config", "state", "timeout"]), json_values, max_size=3
).flatmap(
    lambda d: st.text(alphabet="abcdefghij", min_size=3, max_size=8).map(
        lambda k: json.dumps({**d, f"zz_{k}": 1}).encode()
    )
)
wrong_types = st.fixed_dictionaries({"id": st.integers() | st.text(max_size=13) | st.lists(st.integers())}).map(
    lambda d: json.dumps(d).encode()
)
bad_payloads = not_json | not_object | unknown_field | wrong_types


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _subject(worker: WorkerProcess, name: str) -> str:
    if name in OTHER:
        return f"fauxmad.v1.worker.{worker.worker_id}.{name}"
    if name == "offers":
        return f"fauxmad.v1.offers.{worker.region}"
    return f"fauxmad.v1.worker.{worker.worker_id}.machines.{name}"


def test_fuzzed_payloads_get_400_and_change_nothing(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()
    seen: list[tuple[str, bytes, int]] = []

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from([*VERBS, *OTHER, "offers"]), payload=bad_payloads)
    def check(name: str, payload: bytes) -> None:
        if name == "list" and payload in (b"{}",):
            return

        async def send() -> tuple[int, Any]:
            nc = await nats.connect(worker.nats_url)
            try:
                msg = await nc.request(_subject(worker, name), payload, timeout=5)
            finally:
                await nc.close()
            return int((msg.headers or {}).get("Nats-Service-Error-Code", 200)), msgspec.json.decode(msg.data)

        code, body = arun(send())
        seen.append((name, payload, code))
        assert code == 400, (name, payload, code, body)
        assert body["error"]["code"] == 400 and body["error"]["message"]

    check()
    assert len(seen) >= 100

    async def still_alive() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        assert await raw.ok("list", {}) == []  # nothing was created by any of it
        m = await raw.ok("reserve", {"app": "a", "region": worker.region, "config": {"cmd": ["sleep", "5"]}})
        await raw.ok("start", {"id": m["id"]})
        await raw.ok("destroy", {"id": m["id"], "force": True})
        info = json.loads((await nc.request(f"fauxmad.v1.worker.{worker.worker_id}.info", b"")).data)
        assert info["cordoned"] is False
        await nc.close()

    arun(still_alive())
    assert worker.proc is not None and worker.proc.poll() is None


def test_unknown_verb_and_bad_values_are_400(worker_factory: Callable[..., WorkerProcess]) -> None:
    worker = worker_factory()

    async def main() -> None:
        nc = await nats.connect(worker.nats_url)
        raw = RawClient(nc, worker.worker_id)
        for verb, payload in [
            ("explode", {}),
            ("reserve", {"app": "a", "region": worker.region, "config": {"cmd": []}}),
            ("reserve", {"app": "a.b", "region": worker.region, "config": {"cmd": ["x"]}}),
            ("reserve", {"app": "a", "region": worker.region, "config": {"cmd": ["x"], "guest": {"memory_mb": 0}}}),
            (
                "reserve",
                {"app": "a", "region": worker.region, "config": {"cmd": ["x"], "restart": {"policy": "maybe"}}},
            ),
            ("signal", {"id": "0123456789abcd", "signal": "SIGNOPE"}),
            ("wait", {"id": "0123456789abcd", "state": "sleeping"}),
            ("stop", {"id": "0123456789abcd", "timeout": -1}),
        ]:
            code, body = await raw.send(verb, payload)
            assert code == 400, (verb, payload, body)
        assert await raw.ok("list", {}) == []
        await nc.close()

    arun(main())
