"""Hosts on one box: N Linux network namespaces on one bridge, each with its own address.

A fleet of many hosts is what fauxmad is for, and a fleet on loopback hides every one-host assumption: a
part that dials the loopback address works there and nowhere else. So `fauxmad dev --hosts N` and the tests run the
fleet's parts on hosts of their own, made here: host `a` is namespace `fauxmad-<fleet>-a` at
10.213.<fleet>.11, `b` at .12 and so on, each with a veth into the bridge `fxh<fleet>br`, on which the root
namespace (the laptop, where the CLI runs) has .1. A process starts inside a host with `ip netns exec`,
which execs the command itself, so its pid is the process's own (signals and waits need nothing more).

Names carry the fleet's number, so two harnesses on one box never collide, and the number is claimed with
a lock file (`/run/fauxmad-hosts/<fleet>.lock`, flock) held for the harness's life: a harness that crashed
released its lock with its process, and the next one sweeps every namespace and bridge of our prefix whose
lock nobody holds (killing the processes still inside: a namespace lives as long as one process does).

Faults, each verified on this kernel without iptables or netem: `cut(host)` sets the host's veth down
(both directions fail, as a pulled cable); `cut_outgoing(host)` puts a `blackhole` qdisc on the host's
interface, which silently drops every packet the host sends (others' packets still arrive; its answers
never leave), a one-way partition; `slow(host, rate, queue)` puts a `tbf` qdisc there instead (a token bucket:
the host's packets wait their turn at `rate`), a latency spike for what the host sends.

Needs root and Linux; `unavailable()` says in one line why not otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

NETNS_PREFIX = "fauxmad-"  # namespaces fauxmad-<fleet>-<host>
LINK_PREFIX = "fxh"  # interfaces fxh<fleet>br (the bridge) and fxh<fleet>h<index> (a host's veth, root side)
NET = "10.213"  # fleet n gets 10.213.n.0/24: private, and unlikely to be anyone's LAN
STATE_DIR = Path("/run/fauxmad-hosts")
MAX_HOSTS = 20
_OURS = re.compile(rf"^{re.escape(NETNS_PREFIX)}(\d+)-([a-z]+)$")


class Host(msgspec.Struct, frozen=True, kw_only=True):
    """One host: its name (`a`), namespace, address, and its veth's root-side name (what a cut sets down)."""

    name: str
    index: int  # 0-based
    netns: str
    address: str
    veth: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]


def unavailable() -> str | None:
    """Why hosts cannot be made here (one line), or None."""
    if sys.platform != "linux":
        return f"hosts are Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "hosts are network namespaces, which need root (run as root, or use a fleet on loopback)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or probe.returncode}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _our_namespaces() -> dict[int, list[str]]:
    """Every namespace of our prefix, by fleet number."""
    found: dict[int, list[str]] = {}
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _OURS.match(name)
        if match:
            found.setdefault(int(match.group(1)), []).append(name)
    return found


def _kill_inside(netns: str) -> None:
    """SIGKILL every process inside `netns` (a namespace outlives its `ip netns del` while one is left)."""
    for pid in _ip("netns", "pids", netns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_fleet(number: int, namespaces: list[str]) -> None:
    for netns in namespaces:
        _kill_inside(netns)
    for netns in namespaces:
        _ip("netns", "del", netns, check=False)
    _ip("link", "del", f"{LINK_PREFIX}{number}br", check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():  # veths left by a half-made host
        fields = line.split(":")
        if len(fields) > 1:
            name = fields[1].strip().split("@")[0]
            if name.startswith(f"{LINK_PREFIX}{number}h"):
                _ip("link", "del", name, check=False)


def _try_lock(number: int) -> int | None:
    """The lock of fleet `number` (an open fd holding it), or None when another harness holds it."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(STATE_DIR / f"{number}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def sweep() -> int:
    """Remove every namespace and bridge of our prefix whose harness is gone (its lock free); returns how many
    fleets were removed."""
    removed = 0
    numbers = set(_our_namespaces())
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        match = re.match(rf"^\d+: {LINK_PREFIX}(\d+)br[:@]", line)
        if match:
            numbers.add(int(match.group(1)))
    for number in sorted(numbers):
        fd = _try_lock(number)
        if fd is None:
            continue  # a live harness
        try:
            _remove_fleet(number, _our_namespaces().get(number, []))
            removed += 1
        finally:
            os.close(fd)
    return removed


def _subnet_taken(number: int) -> bool:
    """Whether 10.213.<number>.0/24 overlaps a route of this box (someone's network): never use it then."""
    ours = ipaddress.ip_network(f"{NET}.{number}.0/24")
    for line in _ip("-4", "route", "show", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first == "default":
            continue
        with contextlib.suppress(ValueError):
            if ipaddress.ip_network(first, strict=False).overlaps(ours):
                return True
    return False


class Hosts:
    """`with Hosts(4) as hosts:` hosts a, b, c, d; `hosts["b"].address`, `hosts.cut("b")`, `hosts.heal("b")`."""

    def __init__(self, count: int) -> None:
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"hosts: between 1 and {MAX_HOSTS}, not {count}")
        self.count = count
        self.number: int | None = None
        self.hosts: list[Host] = []
        self._lock: int | None = None

    @property
    def gateway(self) -> str:
        """The laptop's address on the bridge (the root namespace)."""
        assert self.number is not None
        return f"{NET}.{self.number}.1"

    @property
    def bridge(self) -> str:
        return f"{LINK_PREFIX}{self.number}br"

    def __getitem__(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def up(self) -> Hosts:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        sweep()
        for number in range(1, 255):
            if _subnet_taken(number):
                continue
            fd = _try_lock(number)
            if fd is None:
                continue
            self._lock, self.number = fd, number
            break
        else:
            raise RuntimeError(f"no free fleet number: every {NET}.n.0/24 is taken or locked")
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        number = self.number
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index in range(self.count):
            name = chr(ord("a") + index)
            host = Host(
                name=name,
                index=index,
                netns=f"{NETNS_PREFIX}{number}-{name}",
                address=f"{NET}.{number}.{11 + index}",
                veth=f"{LINK_PREFIX}{number}h{index}",
            )
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            self.hosts.append(host)
        self._wait_carrier()

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        """Until every veth of the bridge forwards (a bridge port takes a moment to come up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            shown = _ip("-o", "link", "show", "master", self.bridge, check=False).stdout
            if shown.count("LOWER_UP") >= len(self.hosts) and "state UP" in shown:
                return
            time.sleep(0.05)

    def cut(self, name: str) -> None:
        """Pull host `name`'s cable: nothing in or out until `heal`."""
        _ip("link", "set", self[name].veth, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self[name].veth, "up")
        self._wait_carrier()

    def cut_outgoing(self, name: str) -> None:
        """Drop every packet host `name` sends (what it is sent still arrives): a one-way partition."""
        done = subprocess.run(
            self[name].command(["tc", "qdisc", "replace", "dev", "eth0", "root", "blackhole"]),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"tc could not drop {name}'s packets: {done.stderr.strip()}")

    def slow(self, name: str, rate: str, queue: str) -> None:
        """Slow host `name`'s sending to `rate` (a `tbf` qdisc), its packets queued up to `queue` and then dropped: a
        latency spike that grows with what the host sends (this kernel has no netem to add a fixed delay)."""
        done = subprocess.run(
            self[name].command(
                ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "4kb", "latency", queue]
            ),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"tc could not slow {name}'s link: {done.stderr.strip()}")

    def heal_outgoing(self, name: str) -> None:
        subprocess.run(
            self[name].command(["tc", "qdisc", "del", "dev", "eth0", "root"]), capture_output=True, check=False
        )

    def down(self) -> None:
        """Kill whatever still runs inside the hosts, remove them and the bridge, release the fleet's number."""
        if self.number is not None and self._lock is not None:
            _remove_fleet(self.number, _our_namespaces().get(self.number, []))
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        self.hosts = []

    def __enter__(self) -> Hosts:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
