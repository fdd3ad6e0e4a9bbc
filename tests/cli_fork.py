"""`fauxmad` commands for the suite without an interpreter start each: forked from one that has imported the CLI.

Why: the suite runs about a thousand CLI commands, and a fresh `python -m orchestrator.cli` spends a quarter of a
second of CPU importing typer, rich, nats-py and the command modules and building typer's commands before it does
anything; on two cores that was a tenth of the whole suite's CPU. Each xdist worker starts one server (`serve`) that
imports all of it once and builds the commands; a command is then a `fork()` of that server, which takes the
caller's stdin, stdout and stderr (passed over a Unix socket), environment, working directory and arguments, and
runs `main()` as `python -m orchestrator.cli` would. The server reaps it and sends back its wait status: an exit
code, or the signal that killed it, as `subprocess` reports them.

What a forked command does not show, the tests that need it start a real interpreter (`helpers.fauxmad(...,
fresh=True)`, or their own `subprocess`): the import of a single command's module in a fresh process (every
command's `--help` does, in test_cli), the start-up time, signals sent to a command while it starts. The server is
a child of the xdist worker and ends when the worker's end of its stdin closes. `FAUXMAD_TEST_FORK=0` turns the
forking off for a whole run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = struct.Struct("!I")  # the length of the request's JSON that follows it
ENTRY = str(ROOT / "orchestrator" / "cli" / "__main__.py")  # sys.argv[0] of `python -m orchestrator.cli`


STARTUP = ("PYTHON", "LD_", "FAKETIME")  # variables an interpreter reads as it starts (a fork has started already)


def enabled() -> bool:
    return os.environ.get("FAUXMAD_TEST_FORK", "1") != "0"


def _startup(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name.startswith(STARTUP)}


def forkable(env: Mapping[str, str]) -> bool:
    """Whether a command with `env` can be forked: forking is on and `env` starts an interpreter as the server's
    did (a `LD_PRELOAD`, a `FAKETIME` or a `PYTHON...` variable of its own needs a fresh one)."""
    return enabled() and _startup(env) == _startup(_server_env())


def _server_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT)) if _server is None else _server[2]


# ---------------------------------------------------------------------------------------------------
# the server (`python -m tests.cli_fork SOCKET`)


def serve(path: str) -> None:
    """Import the CLI with all its commands, then fork a command for each connection, until stdin closes."""
    import asyncio

    from orchestrator.cli import app as cli

    cli.register(None)
    cli._click_command()  # what every command would make again: typer's click command
    # a fork copies one thread and shares open descriptors: nothing imported may have started a thread or a loop
    assert threading.active_count() == 1, threading.enumerate()
    assert asyncio.get_event_loop_policy()._local._loop is None  # type: ignore[attr-defined]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a handler, so the wakeup fd hears of it
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
    while True:
        readable, _, _ = select.select([listener, sys.stdin, wake_r], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            break  # the xdist worker is gone
        if wake_r in readable:
            os.read(wake_r, 512)
        _reap(running)
        if listener in readable:
            conn, _ = listener.accept()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for fd in (wake_r, wake_w):
                    os.close(fd)
                for other in running.values():
                    other.close()
                _command(conn)  # never returns
            running[pid] = conn
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _reap(running: dict[int, socket.socket]) -> None:
    """Send each ended command's wait status to whoever asked for it."""
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _command(conn: socket.socket) -> None:
    """In the forked child: become the command the connection describes, run it, exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgrp()  # the caller kills it (and what it started) as one group on a timeout
        size = HEADER.size
        head, fds, _, _ = socket.recv_fds(conn, size, 3)
        (length,) = HEADER.unpack(head)
        body = b""
        while len(body) < length:
            chunk = conn.recv(length - len(body))
            if not chunk:
                os._exit(1)
            body += chunk
        request = json.loads(body)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        conn.sendall(f"{os.getpid()}\n".encode())
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = [ENTRY, *request["args"]]
        from orchestrator.cli import render
        from orchestrator.cli.app import main

        # the one thing the CLI makes at import from its environment: the console (its width from $COLUMNS),
        # which the command modules imported by name; made again here, into the same object
        render.console.__dict__.update(render.make_console().__dict__)

        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------------------------------------------
# the caller (tests.helpers.fauxmad)

_lock = threading.Lock()
_server: tuple[subprocess.Popen[bytes], str, dict[str, str]] | None = None  # the process, its socket, its env


def _started() -> str:
    """The socket of this process's server, started on the first call."""
    global _server
    with _lock:
        if _server is not None and _server[0].poll() is None:
            return _server[1]
        path = os.path.join(tempfile.mkdtemp(prefix="fauxmad-cli-"), "socket")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        server = subprocess.Popen(
            [sys.executable, "-m", "tests.cli_fork", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=str(ROOT),
        )
        assert server.stdout is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the CLI fork server did not start (exit {server.wait()})")
        _server = (server, path, env)
        atexit.register(_stop, server, path)
        return path


def _stop(server: subprocess.Popen[bytes], path: str) -> None:
    assert server.stdin is not None
    server.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(5)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


def _text(data: bytes) -> str:
    """As `subprocess.run(..., text=True)` gives it: decoded, with universal newlines."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


def run(args: list[str], env: Mapping[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m orchestrator.cli ARGS` with `env` in `cwd`, forked from the server; like `subprocess.run` with
    `capture_output=True, text=True, timeout=timeout` (the command is killed, with what it started, on a timeout)."""
    with (
        open(os.devnull, "rb") as stdin,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        try:
            code = run_on(args, env, cwd, timeout, (stdin.fileno(), out.fileno(), err.fileno()))
        except subprocess.TimeoutExpired as expired:
            out.seek(0)
            err.seek(0)
            raise subprocess.TimeoutExpired(expired.cmd, timeout, out.read(), err.read()) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(_argv(args), code, _text(out.read()), _text(err.read()))


def run_on(args: list[str], env: Mapping[str, str], cwd: Path, timeout: float, fds: tuple[int, int, int]) -> int:
    """The command forked with `fds` as its stdin, stdout and stderr (a terminal's, a file's); its exit code once
    it has ended (negative: the signal that killed it). Past `timeout` it is killed with what it started, and
    `subprocess.TimeoutExpired` raised."""
    path = _started()
    request = json.dumps({"args": args, "env": dict(env), "cwd": str(cwd)}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        socket.send_fds(conn, [HEADER.pack(len(request))], list(fds))
        conn.sendall(request)
        conn.settimeout(timeout)
        reply = conn.makefile("rb")
        pid = int(reply.readline() or b"0")  # the child's first word, before the command runs
        if pid <= 0:
            raise RuntimeError(f"the CLI fork server's child for {args} ended before it ran")
        try:
            line = reply.readline()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(_argv(args), timeout) from None
        if not line:
            raise RuntimeError(f"the CLI fork server went away while running {args}")
        return int(line)


def _argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "orchestrator.cli", *args]


if __name__ == "__main__":
    serve(sys.argv[1])
