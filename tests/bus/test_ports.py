"""Free ports: below the kernel's ephemeral range (no outgoing connection takes one meanwhile), never repeated,
and split so two processes never pick in the same ports: servers in one half, machines in the other, each worker
a slice of that half (bus/local/ports.py says why)."""

from __future__ import annotations

import itertools
import socket

import pytest

from bus.local import ports
from bus.local.ports import MachineSlices, PortRange


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
        ports._handed.forget()
        lately = ports.free_port()
        free = ports.free_port()
        ports._handed.forget(free)
        draws = iter([held, lately, held, free])
        monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
        assert ports.free_port() == free  # the listened-on port and the recent one were both drawn first


def test_a_port_the_caller_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    ports._handed.forget()
    held, free = ports.free_port(), ports.free_port()
    ports._handed.forget()
    draws = iter([held, free])
    monkeypatch.setattr(ports.random, "randint", lambda low, high: next(draws))
    assert ports.free_port(held={held}) == free  # a stopped machine's port: nothing listens on it now


def test_servers_and_machines_pick_in_halves_that_do_not_meet() -> None:
    servers, machines = ports.servers_range(), ports.machine_ports()
    assert servers.high < machines.low
    assert all(servers.low <= ports.free_port() <= servers.high for _ in range(200))
    assert all(machines.low <= ports.free_port(within=machines) <= machines.high for _ in range(200))


def test_each_worker_gets_a_slice_nobody_else_holds_until_it_is_given_back() -> None:
    whole = PortRange(20_000, 21_599)
    pool = MachineSlices(whole, count=16, start=5)
    taken = [pool.take() for _ in range(16)]
    assert len(set(taken)) == 16 and taken[0] == PortRange(20_500, 20_599)  # begins at slice `start`
    assert all(a.high < b.low for a, b in itertools.pairwise(sorted(taken)))
    assert min(taken).low == whole.low and max(taken).high == whole.high
    assert pool.take() == whole  # all held: the next worker shares the whole half, as every worker did before
    pool.give_back(taken[3])
    assert pool.take() == taken[3]


def test_a_small_range_is_picked_in_to_its_end_and_comes_round_again() -> None:
    """A worker's slice: 100 ports, 300 picks. The picks stay in it (a memory of the last 4,096 picks would have
    sent every pick after the 100th to `bind(0)`, the ephemeral range), and none of the last 50 repeats."""
    low = ports.machine_ports().low
    small = PortRange(low, low + 99)
    picked = [ports.free_port(within=small) for _ in range(300)]
    assert all(small.low <= port <= small.high for port in picked), picked
    assert all(len(set(picked[i : i + 50])) == 50 for i in range(len(picked) - 50))


@pytest.mark.parametrize(
    ("text", "why"),
    [("abc", "is not a port range"), ("300-200", "no higher than the last"), ("0-10", "from 1 to 65535")],
)
def test_a_range_that_is_not_one_says_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        PortRange.parse(text)
