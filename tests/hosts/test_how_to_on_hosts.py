"""The several-hosts how-to (docs/how-to/several-hosts.md), its blocks run as written on hosts of one box (issue 40).

Each host of the how-to is a host of the harness (`orchestrator.devhosts`: a network namespace with its own
address) that also has a filesystem of its own where the how-to writes: `/etc`, `/var/lib` and `/opt` are
overlays on tmpfs, made in a mount (and UTS) namespace a holder process keeps for the test's life; every
command of that host runs inside it with `nsenter`. Nothing the how-to writes reaches the box's own /etc.
Each host's `/etc/hosts` names host a `nats.internal` (what the how-to asks of a DNS), and its `/opt/fauxmad`
is this checkout's virtualenv (`/opt/fauxmad/bin/fauxmad`, `.../nats-server`), as the how-to installs it.

- host a: the nats-server host (steps 1 and 2) and the broker host (step 3 with the broker's unit);
- host b: the worker host, named `mad-1`, its address in place of the how-to's 10.0.0.11 (step 3);
- the laptop (the box itself, a filesystem of its own too): step 4, with the operator's credentials.

A `systemctl daemon-reload && systemctl enable --now X` line is replaced by the process of X's unit in
deploy/systemd: its `ExecStart=` with its `Environment=` (`%H`: the host's name), started inside that host as
systemd would, from /. Not its `ExecStartPre=` (the worker's remounts the box's cgroup2: global). The copies
the how-to describes in prose (each identity's files to its host) are made with tar between the hosts.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from orchestrator.devhosts import Host, Hosts, unavailable
from tests.helpers import ROOT, wait_until
from tests.orchestrator.fleet.test_readme import shell_env

REASON = unavailable() or (None if shutil.which("nsenter") and shutil.which("unshare") else "needs util-linux")
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"needs hosts: {REASON}"), pytest.mark.timeout(300)]

HOW_TO = ROOT / "docs" / "how-to" / "several-hosts.md"
UNITS = ROOT / "deploy" / "systemd"
EXAMPLE_WORKER_ADDRESS = "10.0.0.11"  # the how-to's worker host; here host b's own address
SYSTEMCTL = re.compile(r"^systemctl daemon-reload && systemctl enable --now (\S+)$")
FLEET = "/etc/fauxmad/fleet"


def steps() -> dict[str, str]:
    """The how-to's `sh` block of each numbered section ("1", "2", ...)."""
    found: dict[str, str] = {}
    for section in HOW_TO.read_text().split("\n## ")[1:]:
        number = section.split(".", 1)[0]
        block = re.search(r"```sh\n(.*?)```", section, re.S)
        if number.isdigit() and block:
            found[number] = block.group(1)
    return found


def unit(name: str, hostname: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of deploy/systemd/`name`.service (`%H`: `hostname`)."""
    argv: list[str] = []
    env: dict[str, str] = {}
    for line in (UNITS / f"{name}.service").read_text().splitlines():
        line = line.replace("%H", hostname)
        if line.startswith("Environment="):
            key, _, value = line.removeprefix("Environment=").partition("=")
            env[key] = value
        elif line.startswith("ExecStart="):
            argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv, f"{name}.service has no ExecStart="
    return argv, env


class Machine:
    """One host of the how-to: its network (a harness host, or the box's for the laptop) and a filesystem and
    host name of its own, kept by a holder process; `run` runs shell text there, `start` a unit's process."""

    def __init__(self, name: str, hostname: str, host: Host | None, nats: str, scratch: Path) -> None:
        self.name, self.hostname, self.host = name, hostname, host
        self.logs = scratch / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        mount = scratch / f"fs-{name}"
        mount.mkdir()
        binaries = {"fauxmad": shutil.which("fauxmad", path=shell_env()["PATH"]), "nats-server": nats_server()}
        links = "; ".join(f"ln -s {shlex.quote(str(path))} /opt/fauxmad/bin/{b}" for b, path in binaries.items())
        script = f"""set -e
mount -t tmpfs fauxmad-host {mount}
for d in etc var/lib opt; do
  mkdir -p {mount}/$d/upper {mount}/$d/work
  mount -t overlay fauxmad-host -o lowerdir=/$d,upperdir={mount}/$d/upper,workdir={mount}/$d/work /$d
done
mkdir -p /etc/systemd/system /opt/fauxmad/bin
{links}
echo '{nats} nats.internal' >> /etc/hosts
hostname {hostname}
echo ready
exec sleep 100000
"""
        argv = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", script]
        self.holder = subprocess.Popen(
            host.command(argv) if host is not None else argv, stdout=subprocess.PIPE, text=True
        )
        assert self.holder.stdout is not None and self.holder.stdout.readline().strip() == "ready", name
        self.processes: list[subprocess.Popen[bytes]] = []

    def enter(self, wd: str) -> list[str]:
        """nsenter into this host, in `wd` (a directory of the box's: nsenter opens it before it enters)."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-u", "-n", f"--wd={wd}", "--"]

    def run(self, text: str, transcript: list[str]) -> str:
        """Shell text in this host, from the checkout (the clone the how-to installs from); it must exit 0."""
        done = subprocess.run(
            [*self.enter(str(ROOT)), "bash", "-euo", "pipefail", "-xc", text],
            capture_output=True, text=True, env=shell_env(), timeout=120,
        )  # fmt: skip
        transcript.append(f"[{self.name}] {done.stderr.rstrip()}\n{done.stdout.rstrip()}")
        assert done.returncode == 0, "\n".join(transcript)
        return done.stdout

    def start(self, name: str) -> None:
        """What `systemctl enable --now <name>` starts: the unit's ExecStart, its Environment, from /."""
        argv, env = unit(name, self.hostname)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": str(ROOT), **env}
        with (self.logs / f"{self.name}-{name}.log").open("wb") as log:
            self.processes.append(
                subprocess.Popen(
                    [*self.enter("/"), "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
                    stdout=log,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                )
            )

    def read(self, paths: list[str]) -> bytes:
        """A tar of `paths` under the fleet directory (what scp would carry)."""
        return subprocess.run(
            [*self.enter("/"), "tar", "-C", FLEET, "-cf", "-", *paths], capture_output=True, check=True
        ).stdout

    def write(self, archive: bytes) -> None:
        unpack = f"mkdir -p {FLEET} && tar -C {FLEET} -xpf -"
        subprocess.run([*self.enter("/"), "sh", "-c", unpack], input=archive, capture_output=True, check=True)

    def stop(self) -> None:
        everything: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = [*self.processes, self.holder]
        for proc in everything:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def nats_server() -> str:
    found = shutil.which("nats-server", path=shell_env()["PATH"])
    assert found, "nats-server is not installed"
    return found


def identity(name: str) -> list[str]:
    """What an identity is made of, relative to the fleet directory (the how-to's step 1, "Copy ...")."""
    return ["ca.pem", f"creds/{name}.json", f"creds/{name}.pem", f"creds/{name}-key.pem"]


def listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=0.5).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Hosts, dict[str, Machine]]]:
    scratch = tmp_path_factory.mktemp("how-to")
    with Hosts(2) as made:
        nats = made["a"].address
        machines: dict[str, Machine] = {}
        try:
            machines["a"] = Machine("a", "nats-1", made["a"], nats, scratch)
            machines["b"] = Machine("b", "mad-1", made["b"], nats, scratch)
            machines["laptop"] = Machine("laptop", "laptop", None, nats, scratch)
            yield made, machines
        finally:
            for machine in machines.values():
                machine.stop()


def run_step(machine: Machine, block: str, transcript: list[str], *, wait: tuple[str, int] | None = None) -> None:
    """A block's lines in `machine`, each `systemctl ... enable --now X` line replaced by X's process."""
    pending: list[str] = []
    for line in block.splitlines():
        started = SYSTEMCTL.match(line.strip())
        if started is None:
            pending.append(line)
            continue
        if pending:
            machine.run("\n".join(pending), transcript)
            pending = []
        machine.start(started.group(1))
        transcript.append(f"[{machine.name}] started {started.group(1)} (its unit's ExecStart)")
        if wait is not None:  # a server's unit: the next line talks to it (a person would wait for it too)
            address, port = wait
            wait_until(partial(listening, address, port), f"{started.group(1)} on {address}:{port}", 20, 0.2)
    if pending:
        machine.run("\n".join(pending), transcript)


@pytest.mark.fleet  # starts processes of its own
def test_the_several_hosts_how_to_runs_as_written(hosts: tuple[Hosts, dict[str, Machine]]) -> None:
    made, machines = hosts
    a, b, laptop = machines["a"], machines["b"], machines["laptop"]
    blocks = steps()
    assert sorted(blocks) == ["1", "2", "3", "4"], blocks
    transcript: list[str] = []
    began = time.monotonic()
    had_etc_fauxmad = Path("/etc/fauxmad").exists()

    run_step(a, blocks["1"].replace(EXAMPLE_WORKER_ADDRESS, made["b"].address), transcript)
    b.write(a.read(identity("worker-mad-1")))  # "Copy each process's ... to its host"
    laptop.write(a.read(identity("operator")))
    run_step(a, blocks["2"], transcript, wait=(made["a"].address, 4222))
    run_step(a, blocks["3"].replace("fauxmad-worker", "fauxmad-broker"), transcript)  # "the same" on the broker host
    run_step(b, blocks["3"], transcript)

    def listed() -> str | None:
        done = subprocess.run(
            [*laptop.enter(str(ROOT)), "bash", "-euo", "pipefail", "-c", blocks["4"]],
            capture_output=True, text=True, env=shell_env(), timeout=60,
        )  # fmt: skip
        return done.stdout if done.returncode == 0 and re.search(r"\bmad-1\b", done.stdout) else None

    try:
        shown = wait_until(listed, "the CLI on the laptop listing worker mad-1 (step 4)", 60, 1.0)
    except AssertionError:
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(a.logs.glob("*.log")))
        raise AssertionError("\n".join(transcript) + "\n" + logs) from None
    assert shown is not None
    print(f"\nthe how-to ran on hosts in {time.monotonic() - began:.1f}s:\n{shown}")
    assert re.search(r"\bmad-1\b.*\bready\b", shown), shown
    worker = b.processes[0]
    assert worker.poll() is None, "the worker exited"
    ns = subprocess.run(["ip", "netns", "identify", str(worker.pid)], capture_output=True, text=True).stdout
    assert ns.strip() == made["b"].netns  # nsenter execs: the pid is the worker's own
    assert Path("/etc/fauxmad").exists() == had_etc_fauxmad, "the how-to wrote into the box's own /etc"
