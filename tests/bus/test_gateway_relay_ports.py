"""The gateway relay's listening ports are picked the way every other server port of a dev fleet is
(`bus.local.ports.free_port`): below the kernel's ephemeral range, in the test runner's own slice. CI32 (four
files at a time) lost a whole supercluster file to a relay port picked with `bind(0)`: an ephemeral port, which the
routes of the fleet's own servers (or any outgoing connection of the host) took before the relay listened. And a
relay whose start failed stops at once, so the failure is the one reported (it was a 10 s TimeoutError in `stop`)."""

from __future__ import annotations

import socket
import time

import pytest

from bus.local.gateway_relay import GatewayRelay
from bus.local.ports import servers_range


def test_front_ports_are_below_the_ephemeral_range_or_in_the_runners_slice() -> None:
    relay = GatewayRelay()
    lowest, high = servers_range().low, servers_range().high + 1
    ports = [relay.front("r", "127.0.0.1", 7222) for _ in range(20)]
    assert all(lowest <= port < high for port in ports), (ports, lowest, high)
    assert len(set(ports)) == len(ports)


def test_a_relay_whose_port_is_taken_fails_at_start_and_stops_at_once() -> None:
    relay = GatewayRelay()
    port = relay.front("r", "127.0.0.1", 7222)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(OSError, match="address already in use"):
            relay.start()
    started = time.perf_counter()
    relay.stop()  # before the fix: run_coroutine_threadsafe on a loop nobody runs, TimeoutError after 10 s
    # not a timing assertion on speed: the stop either returns or hangs for its 10 s timeout, nothing between
    assert time.perf_counter() - started < 5
