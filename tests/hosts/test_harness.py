"""The hosts harness itself (`orchestrator.devhosts`): addresses of their own, cuts both ways and one way, two
harnesses side by side, and a crashed harness's namespaces swept by the next one.

No fleet here: a TCP listener inside a host is enough to see a cut, and a harness killed with SIGKILL is what a
crashed test run leaves behind.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from orchestrator.devhosts import NETNS_PREFIX, Hosts, unavailable
from tests.helpers import ROOT, wait_until

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs hosts: {REASON}")

LISTEN = "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 5000)); s.listen(); time.sleep(120)"


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(NETNS_PREFIX)]


def reaches(address: str, port: int = 5000) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.fleet  # starts processes of its own
def test_a_host_has_its_own_address_and_its_link_can_be_cut_both_ways_or_one_way() -> None:
    with Hosts(2) as hosts:
        b = hosts["b"]
        assert b.address != hosts["a"].address and b.address.startswith("10.213.")
        listener = subprocess.Popen(b.command([sys.executable, "-c", LISTEN]))
        try:
            wait_until(lambda: reaches(b.address), "a listener inside host b reachable from the laptop")
            assert not reaches("127.0.0.1"), "host b's listener must not be on the laptop's loopback"
            hosts.cut(b.name)
            assert not reaches(b.address)
            hosts.heal(b.name)
            wait_until(lambda: reaches(b.address), "host b reachable after the heal")
            hosts.cut_outgoing(b.name)  # its answers (the SYN-ACK) never leave
            assert not reaches(b.address)
            hosts.heal_outgoing(b.name)
            wait_until(lambda: reaches(b.address), "host b reachable after the one-way heal")
        finally:
            listener.kill()
            listener.wait()
    assert not [n for n in namespaces() if n.startswith(f"{NETNS_PREFIX}{hosts.number}-")]


@pytest.mark.fleet  # starts processes of its own
def test_two_harnesses_never_collide_and_a_crashed_ones_hosts_are_swept() -> None:
    crashed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from orchestrator.devhosts import Hosts; h = Hosts(2).up(); "
            "print(h.number, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
    )
    assert crashed.stdout is not None
    number = int(crashed.stdout.readline())
    with Hosts(2) as beside:  # while the other one lives: a fleet number of its own, the other's hosts untouched
        assert beside.number != number
        assert f"{NETNS_PREFIX}{number}-a" in namespaces()
    crashed.send_signal(signal.SIGKILL)
    crashed.wait()
    assert f"{NETNS_PREFIX}{number}-a" in namespaces(), "a crash leaves its hosts behind (what the sweep is for)"
    with Hosts(1) as after:  # it may take the same number (free again): it has one host, the crashed one had two
        assert f"{NETNS_PREFIX}{number}-b" not in namespaces()
        assert [n for n in namespaces() if n.startswith(f"{NETNS_PREFIX}{number}-")] == (
            [f"{NETNS_PREFIX}{number}-a"] if after.number == number else []
        )
