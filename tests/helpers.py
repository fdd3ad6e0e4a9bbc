"""Shared test plumbing: real nats-server, real worker processes, and a way to run async code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import msgspec
import pytest
import uvloop

from bus.local.ports import machine_slices
from bus.local.server_options import CLIENT_LIVENESS
from tests import cli_fork

if TYPE_CHECKING:
    from orchestrator.devfleet import DevFleet, FleetSpec

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return uvloop.run(coro)


async def connect_nats(url: str, **options: Any) -> Any:
    """`nats.connect` for tests: as the identity in $FAUXMAD_CREDS when set (the suite against secure dev
    fleets, `FAUXMAD_DEV_SECURE=1`), else plain. The client is the fleet's connection class, for its `flush`, which
    returns only once a subscription made before it is in place (`bus.transport.nats_adapter.flushed`)."""
    from bus.transport import credentials
    from bus.transport.connection import servers
    from bus.transport.nats_adapter import Connection

    path = credentials.default_path()
    if path and url.startswith("tls://"):
        creds, base = credentials.load(path)
        options = {**creds.connect_options(base), **options}
    client = Connection()
    await client.connect(servers(url), **options)
    return client


def fauxmad(
    *args: str,
    url: str | None = None,
    columns: int | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    drop: Iterable[str] = (),
    cwd: Path = ROOT,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`fauxmad ARGS` as a user runs it, output captured as text: this interpreter, this checkout on PYTHONPATH and
    (unless `cwd`) as the working directory. `url`: the fleet ($FAUXMAD_NATS_URL); `columns`: the terminal width it is told
    ($COLUMNS, else the caller's); `env`: more variables (they win); `drop`: variables of the caller's it must not
    see. The one runner of the suite's CLI tests: they differed only in these.

    The command is a fork of a process that has imported the CLI already (`tests.cli_fork`: a quarter of a second of
    CPU less each), unless `fresh` (a new interpreter, for what a fork cannot show: a command's own imports) or its
    environment changes how an interpreter starts."""
    full = {name: value for name, value in os.environ.items() if name not in set(drop)}
    full["PYTHONPATH"] = str(ROOT)
    if url is not None:
        full["FAUXMAD_NATS_URL"] = url
    if columns is not None:
        full["COLUMNS"] = str(columns)
    full.update(env or {})
    if not fresh and cli_fork.forkable(full):
        return cli_fork.run(list(args), full, cwd, timeout)
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
        cwd=str(cwd),
    )


def fleet_fixture(spec: FleetSpec, *, scope: Literal["function", "module", "session"] = "module") -> Any:
    """A fixture that runs a dev fleet of `spec` for its module (or `scope`: "function" for a fleet a test may break): `fleet = fleet_fixture(FleetSpec(...))`
    in a test module gives its tests a `fleet` (the name it is assigned to), started before the first that asks and
    stopped after the last. The one way the suite starts a shared fleet; `starts_processes` marks it for the
    `fleet` layer (tests/conftest.py)."""

    def running() -> Iterator[DevFleet]:
        from orchestrator.devfleet import DevFleet

        with DevFleet(spec) as started:
            yield started

    running.starts_processes = True  # type: ignore[attr-defined]
    return pytest.fixture(scope=scope)(running)


def kill_machines_of(worker_id: str, data_dir: Path) -> int:
    """Kill every process of this worker's machines, each with its process group, and look again until a look finds
    none. A process is one of them when it writes under `data_dir` (a shim: forked from the worker's launcher, it
    keeps the launcher's environment, and a workload it is starting has not taken its own yet), or when its
    environment names this worker and it runs in a directory under `data_dir` (a workload: its machine's own
    directory). One look missed a shim that forked its workload just after it (CI55 to CI58: a machine that ignores
    SIGTERM ran on an hour after `test_executor_leases`, whose last step starts it).

    Never by the worker's id alone: ids repeat across the fleets of tests running side by side (`w1`, `mad-w1`), and
    a clean-up that went by the environment alone killed another test's machines (CI66: a secure console's job,
    killed by signal 9 three times in 2 s, was dead-lettered)."""
    needle = f"FAUXMAD_WORKER_ID={worker_id}".encode()
    under = str(data_dir) + os.sep
    killed = 0
    for _ in range(20):
        found = [
            pid for pid in _pids() if _writes_under(pid, under) or (_names_worker(pid, needle) and _runs_in(pid, under))
        ]
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                group = os.getpgid(pid)
                if group != os.getpgid(0):  # never the test's own group
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
        time.sleep(0.05)
    return killed


def _pids() -> list[int]:
    return [
        int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit() and int(entry.name) != os.getpid()
    ]


def _names_worker(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _runs_in(pid: int, under: str) -> bool:
    """Whether the process's working directory is under `under`."""
    try:
        return (os.readlink(f"/proc/{pid}/cwd") + os.sep).startswith(under)
    except OSError:
        return False


def _writes_under(pid: int, under: str) -> bool:
    """Whether one of the process's open files is under `under` (a shim's stdout is its machine's log there)."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith(under):
                return True
    return False


def sockets_to(pid: int, port: int) -> int:
    """How many of `pid`'s TCP sockets have `port` at their far end on this host (any state: a connection whose
    server died stays CLOSE_WAIT until its process reads the end and closes it)."""
    inodes: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                inodes[fields[9]] = int(fields[2].rsplit(":", 1)[1], 16)
    count = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and inodes.get(target[8:-1]) == port:
                    count += 1
    return count


def start_operator(url: str, log: Path, app: str | None = None) -> subprocess.Popen[bytes]:
    """`fauxmad reconcile --watch [-a app]` as a subprocess (a real operator, for one app or for all, its output in
    `log`, lines up to 400 columns), once it watches."""
    env = dict(os.environ, FAUXMAD_NATS_URL=url, PYTHONPATH=str(ROOT), COLUMNS="400")
    with log.open("w") as out:
        operator = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "reconcile", "--watch", *(["-a", app] if app else [])],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
        )
    try:
        wait_until(lambda: "watching" in log.read_text(), "the operator watching", 30)
    except AssertionError:
        operator.kill()
        operator.wait()
        raise
    return operator


def spawn_broker(url: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    """`fauxmad broker --nats URL --name NAME` as a subprocess, its output appended to `log` (with `FAUXMAD_LOG`);
    not waited for: the tests that start one have their own sign it serves."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "broker", "--nats", url, "--name", name],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            cwd=str(ROOT),
            env=dict(os.environ, PYTHONPATH=str(ROOT), FAUXMAD_LOG="1"),
        )


def wait_until(condition: Callable[[], T], what: str, timeout: float = 10.0, interval: float = 0.05) -> T:
    """Poll `condition` until it returns something true, and return that: what a test waits for, in place
    of a sleep long enough for it on a good day. At the deadline an AssertionError says `what` never happened."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(interval)


class Output:
    """What a running process writes to a pipe, gathered as it comes and never waited on: `until` waits (with
    `wait_until`) for the lines so far to show something, and fails at once if the output ended without it."""

    def __init__(self, pipe: Any) -> None:
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._buffer = b""
        self.ended = False
        self.lines: list[str] = []  # every whole line so far, without its newline

    def until(self, shown: Callable[[list[str]], object], what: str, timeout: float = 20.0) -> list[str]:
        """The lines so far, once `shown(lines)` is true."""

        def read() -> bool:
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(self._fd, 65536):
                    self._buffer += chunk
                else:
                    self.ended = True
            *whole, self._buffer = self._buffer.split(b"\n")
            self.lines += [line.decode() for line in whole]
            if shown(self.lines):
                return True
            assert not self.ended, f"{what}: the output ended without it: {self.lines[-20:]}"
            return False

        wait_until(read, what, timeout)
        return self.lines

    def has(self, text: str, what: str = "", timeout: float = 20.0) -> list[str]:
        """The lines so far, once one of them holds `text`."""
        return self.until(lambda lines: any(text in line for line in lines), what or repr(text), timeout)


async def until(condition: Callable[[], Awaitable[T]], what: str, timeout: float = 10.0, interval: float = 0.05) -> T:
    """`wait_until` inside a loop: `condition` is a coroutine function, awaited each round."""
    deadline = time.monotonic() + timeout
    while True:
        result = await condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        await asyncio.sleep(interval)


class WorkerProcess:
    """A real `fauxmad worker` process."""

    def __init__(
        self,
        nats_url: str,
        region: str,
        worker_id: str,
        data_dir: Path,
        *,
        cpus: int = 4,
        memory_mb: int = 4096,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.env = env or {}  # on top of this process's (e.g. tests/faults/points.environment(...))
        self.region = region
        self.worker_id = worker_id
        self.data_dir = data_dir
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "worker.log"
        self.machine_ports = machine_slices().take()  # its own, as a dev fleet gives each worker (bus.local.ports)

    def start(self, timeout: float = 15.0) -> WorkerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "worker",
            "--nats",
            self.nats_url,
            "--region",
            self.region,
            "--worker-id",
            self.worker_id,
            "--cpus",
            str(self.cpus),
            "--memory-mb",
            str(self.memory_mb),
            "--data-dir",
            str(self.data_dir),
            "--restart-backoff",
            "0.1",
            "--max-load",  # the test workers share this host's kernel: see Backpressure
            "0",
            "--machine-ports",
            str(self.machine_ports),
            *self.extra,
        ]
        env = dict(os.environ, FAUXMAD_LOG="1", PYTHONPATH=str(ROOT), **self.env)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env, cwd=str(ROOT))
        log.close()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout

        async def ping() -> bool:
            nc = await connect_nats(self.nats_url)
            try:
                msg = await nc.request(f"fauxmad.v1.worker.{self.worker_id}.info", b"", timeout=0.5)
                info = msgspec.json.decode(msg.data)
                return bool(info.get("pid") == (self.proc.pid if self.proc else None))
            except Exception:
                return False
            finally:
                await nc.close()

        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            if arun(ping()):
                return
            time.sleep(0.05)
        raise RuntimeError(f"worker not ready in {timeout}s: {self.log_path.read_text()[-3000:]}")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.kill9()
        kill_machines_of(self.worker_id, self.data_dir)
        machine_slices().give_back(self.machine_ports)


async def wait_output(worker: WorkerProcess, machine_id: str, text: str, timeout: float = 10.0) -> None:
    """Until a machine's stdout holds `text`: `started` means its process exists, not that it has run its
    first line (a workload that arms a SIGTERM trap must be waited for before a stop can test the trap)."""
    stdout = worker.data_dir / "machines" / machine_id / "stdout.log"

    async def printed() -> bool:
        return stdout.exists() and text.encode() in stdout.read_bytes()

    await until(printed, f"machine {machine_id} printing {text!r} ({stdout})", timeout, interval=0.01)


class RawClient:
    """Speaks the worker contract as another service would: raw JSON over NATS, no project code."""

    def __init__(self, nc: Any, worker_id: str) -> None:
        self.nc = nc
        self.worker_id = worker_id

    async def send(self, verb: str, payload: Any, timeout: float = 10.0) -> tuple[int, Any]:
        data = payload if isinstance(payload, bytes) else msgspec.json.encode(payload)
        msg = await self.nc.request(f"fauxmad.v1.worker.{self.worker_id}.machines.{verb}", data, timeout=timeout)
        code = int((msg.headers or {}).get("Nats-Service-Error-Code", 200))
        return code, msgspec.json.decode(msg.data)

    async def ok(self, verb: str, payload: Any, timeout: float = 10.0) -> Any:
        code, body = await self.send(verb, payload, timeout)
        assert code == 200, f"{verb} {payload} -> {code} {body}"
        return body

    async def wait_state(self, machine_id: str, state: str, timeout: float = 10.0) -> Any:
        return await self.ok("wait", {"id": machine_id, "state": state, "timeout": timeout}, timeout=timeout + 2)


def running(argv: list[str]) -> bool:
    """Whether a process of this host runs exactly `argv` (a machine's, found by a token in its arguments)."""
    wanted = "\0".join(argv).encode() + b"\0"
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes() == wanted:
                return True
        except OSError:
            continue
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def audit_records(nc: Any, app: str) -> list[Any]:
    """Every record of `app`'s audit trail (`bus.contract.streams.AuditRecord`), read over `nc` from the audit
    stream (a create's record too: its worker delivers it there, docs/explanation/architecture.md#one-durable-write-per-create)."""
    from bus.contract import subjects
    from bus.contract.streams import AuditRecord

    sub = await nc.jetstream().subscribe(subjects.audit(app), ordered_consumer=True)
    records: list[AuditRecord] = []
    while True:
        try:
            msg = await sub.next_msg(timeout=1.0)
        except TimeoutError:
            await sub.unsubscribe()
            return sorted(records, key=lambda record: record.at)
        records.append(msgspec.json.decode(msg.data, type=AuditRecord))


def nats_config_denying(port: int, store: Path, user: str, deny: str | None) -> str:
    """A one-server nats-server config (JetStream, synced) with two users: `fleet` may do anything, and `user` may
    publish anywhere but to `deny` (a subject pattern) when it is given: a fault test's way to make one part of the
    fleet lose one JetStream call at a time, then give it back by a reload without the denial."""
    denied = f", permissions: {{publish: {{deny: [{json.dumps(deny)}]}}}}" if deny else ""
    return (
        f"port: {port}\nserver_name: {user}-denied\n"
        f"jetstream {{ store_dir: {json.dumps(str(store))}, sync_interval: always }}\n"
        + "\n".join(CLIENT_LIVENESS)
        + "\n"
        "authorization { users: [\n"
        "  {user: fleet, password: fleet}\n"
        f"  {{user: {user}, password: {user}{denied}}}\n"
        "] }\n"
    )
