"""Health checks against real sockets, a real (tiny) HTTP server and real commands."""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

from tests.helpers import pid_alive, wait_until
from workers.lifecycle.checks import MAX_OUTPUT, CheckResult, run_check

T = TypeVar("T")
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def check(kind: str, **overrides: Any) -> CheckResult:
    options: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": None,
        "path": "/",
        "command": None,
        "timeout": 5.0,
        "env": dict(ENV),
        "cwd": "/",
    }
    options.update(overrides)
    return await run_check(kind, **options)


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def with_server(handler: Handler, body: Callable[[int], Awaitable[T]]) -> T:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await body(port)
    finally:
        server.close()
        await server.wait_closed()


def http_handler(status: str, seen: list[str]) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = (await reader.readuntil(b"\r\n\r\n")).decode()
        seen.append(request)
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok".encode())
        await writer.drain()
        writer.close()

    return handle


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)  # accepts, never answers


# ---------------------------------------------------------------------------------------------------
# tcp


def test_tcp_passing_against_a_listening_socket() -> None:
    async def go() -> CheckResult:
        async def noop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        return await with_server(noop, lambda port: check("tcp", port=port))

    result = run(go())
    assert result.status == "passing" and result.passing


def test_tcp_critical_against_a_closed_port() -> None:
    result = run(check("tcp", port=closed_port()))
    assert result.status == "critical"
    assert "refused" in result.output.lower()


def test_tcp_without_a_port_is_critical() -> None:
    assert run(check("tcp")) == CheckResult("critical", "tcp check needs a port")


# ---------------------------------------------------------------------------------------------------
# http


def test_http_passing_on_200_and_sends_the_path() -> None:
    seen: list[str] = []

    async def probe(port: int) -> CheckResult:
        return await check("http", port=port, path="/health")

    result = run(with_server(http_handler("200 OK", seen), probe))
    assert result == CheckResult("passing", "HTTP/1.1 200 OK")
    assert seen[0].startswith("GET /health HTTP/1.1\r\n")
    assert "\r\nHost: 127.0.0.1:" in seen[0]


def test_http_passing_on_a_redirect() -> None:
    result = run(with_server(http_handler("302 Found", []), lambda port: check("http", port=port)))
    assert result.status == "passing"


def test_http_critical_on_500_with_the_status_line() -> None:
    status = "500 Internal Server Error"
    result = run(with_server(http_handler(status, []), lambda port: check("http", port=port)))
    assert result == CheckResult("critical", f"HTTP/1.1 {status}")


def test_http_critical_when_the_answer_is_not_http() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH\r\n")
        await writer.drain()
        writer.close()

    result = run(with_server(garbage, lambda port: check("http", port=port)))
    assert result.status == "critical" and "not an HTTP response" in result.output


def test_http_critical_against_a_closed_port() -> None:
    assert run(check("http", port=closed_port())).status == "critical"


def test_http_timeout_is_critical() -> None:
    # the server holds the connection open for 30 s: only the check's own timeout can give this result (an
    # answer or the connection's end would be a different one), so no clock is read here
    result = run(with_server(silent, lambda port: check("http", port=port, timeout=0.3)))
    assert result == CheckResult("critical", "timeout after 0.3s")


# ---------------------------------------------------------------------------------------------------
# cmd


def test_cmd_passing_with_env_and_cwd(tmp_path: Path) -> None:
    command = ["sh", "-c", 'echo "$WHO"; pwd']
    result = run(check("cmd", command=command, env={**ENV, "WHO": "me"}, cwd=str(tmp_path)))
    assert result == CheckResult("passing", f"me\n{tmp_path}")


def test_cmd_critical_on_a_nonzero_exit() -> None:
    result = run(check("cmd", command=["sh", "-c", "echo broken >&2; exit 2"]))
    assert result == CheckResult("critical", "exit code 2: broken")


def test_cmd_output_is_the_tail_and_short() -> None:
    result = run(check("cmd", command=["sh", "-c", "seq 1 5000; exit 1"]))
    assert result.status == "critical"
    assert len(result.output) <= MAX_OUTPUT
    assert result.output.startswith("exit code 1: ") and result.output.endswith("4999\n5000")


def test_cmd_timeout_is_critical_and_kills_the_command(tmp_path: Path) -> None:
    # a command that never ends by itself (it waits for a `go` file nobody makes), with a child in its process
    # group: the result can only come from the timeout, and both must be gone when it does
    child = tmp_path / "child.pid"
    waits = f"sleep 600 & echo $! > {child}; while [ ! -e {tmp_path / 'go'} ]; do sleep 0.02; done"
    result = run(check("cmd", command=["sh", "-c", waits], timeout=0.2))
    assert result == CheckResult("critical", "timeout after 0.2s")
    assert child.exists()
    pid = int(child.read_text())
    wait_until(lambda: not pid_alive(pid), "the shell's child killed with its process group")


def test_cmd_that_cannot_run_is_critical() -> None:
    result = run(check("cmd", command=["/nonexistent/check"]))
    assert result.status == "critical" and "/nonexistent/check" in result.output


def test_cmd_without_a_command_and_unknown_kinds_are_critical() -> None:
    assert run(check("cmd")).status == "critical"
    assert run(check("grpc", port=1)) == CheckResult("critical", "unknown check type 'grpc'")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_cmd_runs_as_the_machines_user_under_uvloop() -> None:
    """The worker's loop is uvloop, whose subprocess takes no user/group arguments (the first try answered
    every cmd check of every machine 'critical: unexpected kwargs')."""
    nobody = pwd.getpwnam("nobody")
    run_as = (nobody.pw_uid, nobody.pw_gid)
    result = uvloop.run(check("cmd", command=["sh", "-c", "id -u; id -G"], cwd="/", run_as=run_as))
    assert result == CheckResult("passing", f"{nobody.pw_uid}\n{nobody.pw_gid}")
    assert uvloop.run(check("cmd", command=["test", "-f", "/etc/passwd"], cwd="/")).status == "passing"
