"""Free ports: below the kernel's ephemeral range (no outgoing connection takes one meanwhile), never repeated."""

from __future__ import annotations

import socket

import pytest

from bus.local import ports


def test_ports_are_below_the_ephemeral_range_bindable_and_not_handed_out_twice() -> None:
    low = int(ports.EPHEMERAL_RANGE.read_text().split()[0])
    picked = [ports.free_port() for _ in range(500)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST_PICKED <= port < low for port in picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[-1]))  # nothing listens on it


def test_a_port_something_listens_on_or_handed_out_lately_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        held = taken.getsockname()[1]
        ports._recent.clear()
        lately = ports.free_port()
        free = ports.free_port()
        ports._recent.pop(free)
        draws = iter([held, lately, held, free])
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
        assert ports.free_port() == free  # the listened-on port and the recent one were both drawn first


def test_a_port_the_caller_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    ports._recent.clear()
    held, free = ports.free_port(), ports.free_port()
    ports._recent.clear()
    draws = iter([held, free])
    monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
    assert ports.free_port(held={held}) == free  # a stopped machine's port: nothing listens on it now
