"""The stamps on a new machine, checked against the plain (slower) ways of making them."""

from __future__ import annotations

import random
import socket
from datetime import UTC, datetime

import pytest

from workers.log import stamps as ids

CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def reference_iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def reference_ulid(now: float, randomness: bytes) -> str:
    value = (int(now * 1000) << 80) | int.from_bytes(randomness, "big")
    return "".join(CROCKFORD[(value >> shift) & 31] for shift in range(125, -1, -5))


EDGES = [0.0, 0.0004995, 0.0005, 0.9999994, 0.9999995, 1.0000005, -0.5, -1.0000001, 1700000000.9999996]


def test_iso_rounds_exactly_as_datetime_does() -> None:
    rng = random.Random(7)
    samples = EDGES + [rng.uniform(0, 4e9) for _ in range(20_000)]
    samples += [rng.randrange(4_000_000_000) + rng.randrange(1_000_000) / 1e6 for _ in range(20_000)]
    assert [ids.iso(ts) for ts in samples] == [reference_iso(ts) for ts in samples]


def test_instance_ids_are_ulids(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(11)
    for _ in range(2_000):
        now, randomness = rng.uniform(0, 4e9), rng.randbytes(10)
        monkeypatch.setattr("workers.log.stamps.os.urandom", lambda n, r=randomness: r[:n])
        assert ids.new_instance_id(now) == reference_ulid(now, randomness)
    monkeypatch.undo()
    earlier, later = ids.new_instance_id(1700000000.0), ids.new_instance_id(1700000000.002)
    assert len(earlier) == 26 and earlier[:10] < later[:10]  # time-sortable


def test_pick_port_is_free_to_bind() -> None:
    port = ids.pick_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
