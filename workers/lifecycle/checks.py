"""Health checks (tcp, http, cmd), run by the worker next to the machines they probe.

Why it exists: a machine's health is part of its state (DESIGN.md, "Local supervision"), and deploys
are gated on it, so checks run where the machine runs, not across the network. This module only
answers "is it healthy right now?"; scheduling checks (interval, grace period) and publishing their
status belong to the supervisor.

Key decisions:

- `run_check` never raises: every failure — refused connection, bad status, timeout, missing
  command — is a `critical` result whose output says why, so the caller has one code path. Only
  cancellation propagates, as it must in asyncio.
- No new dependency: http is a minimal HTTP/1.1 GET over asyncio streams, which is all a health
  check needs (status line only; 2xx and 3xx pass, redirects are not followed).
- A cmd check runs in its own session and its whole process group is killed on timeout, so a hung
  check cannot leave processes behind; only the tail of its output is kept while reading.
- Outputs are capped at 512 characters (the tail, for commands): they travel in events on the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, Literal

import msgspec

MAX_OUTPUT = 512
READ_CHUNK = 65536
Status = Literal["passing", "critical"]


class CheckResult(msgspec.Struct, frozen=True):
    status: Status
    output: str = ""

    @property
    def passing(self) -> bool:
        return self.status == "passing"


def _passing(output: str) -> CheckResult:
    return CheckResult("passing", output[-MAX_OUTPUT:])


def _critical(output: str) -> CheckResult:
    return CheckResult("critical", output[-MAX_OUTPUT:])


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def run_check(
    kind: str,
    *,
    host: str,
    port: int | None,
    path: str,
    command: list[str] | None,
    timeout: float,
    env: dict[str, str],
    cwd: str,
    run_as: tuple[int, int] | None = None,
) -> CheckResult:
    """Run one check of `kind` ("tcp", "http" or "cmd"); never raises (except on cancellation). A cmd
    check runs as the machine's user (`run_as`), like the machine."""
    if kind == "cmd":
        if not command:
            return _critical("cmd check needs a command")
        return await _cmd(command, env, cwd, timeout, run_as)
    if kind not in ("tcp", "http"):
        return _critical(f"unknown check type {kind!r}")
    if port is None:
        return _critical(f"{kind} check needs a port")
    probe = _tcp(host, port) if kind == "tcp" else _http(host, port, path)
    return await _with_timeout(probe, timeout)


async def _with_timeout(probe: Coroutine[Any, Any, CheckResult], timeout: float) -> CheckResult:
    try:
        async with asyncio.timeout(timeout):
            return await probe
    except TimeoutError:
        return _critical(f"timeout after {timeout:g}s")
    except Exception as exc:  # the one edge where any failure becomes a check result
        return _critical(_describe(exc))


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _tcp(host: str, port: int) -> CheckResult:
    _, writer = await asyncio.open_connection(host, port)
    await _close(writer)
    return _passing(f"connected to {host}:{port}")


def _host_header(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _http(host: str, port: int, path: str) -> CheckResult:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        target = path if path.startswith("/") else f"/{path}"
        request = (
            f"GET {target} HTTP/1.1\r\n"
            f"Host: {_host_header(host, port)}\r\n"
            "User-Agent: fauxmad-check\r\n"
            "Accept: */*\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(request.encode("latin-1"))
        await writer.drain()
        line = (await reader.readline()).decode("latin-1").strip()
    finally:
        await _close(writer)
    return _http_result(line)


def _http_result(status_line: str) -> CheckResult:
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return _critical(f"not an HTTP response: {status_line!r}")
    code = int(parts[1])
    return _passing(status_line) if 200 <= code < 400 else _critical(status_line)


DROP_TO_USER = """
import os, sys, warnings
os.setgroups([])
os.setgid(int(sys.argv[2]))
os.setuid(int(sys.argv[1]))
os.execvp(sys.argv[3], sys.argv[3:])
"""


async def _cmd(
    command: list[str], env: dict[str, str], cwd: str, timeout: float, run_as: tuple[int, int] | None
) -> CheckResult:
    if run_as is not None:  # uvloop's subprocess takes no user/group: a tiny interpreter drops them, then execs
        command = [sys.executable, "-I", "-S", "-c", DROP_TO_USER, str(run_as[0]), str(run_as[1]), *command]
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except Exception as exc:  # not found, not executable, bad cwd: all a critical result
        return _critical(f"cannot run {command[0]!r}: {_describe(exc)}")
    assert proc.stdout is not None
    finished = False
    try:
        async with asyncio.timeout(timeout):
            output = await _read_tail(proc.stdout)
            await proc.wait()
            finished = True
    except TimeoutError:
        return _critical(f"timeout after {timeout:g}s")
    finally:
        if not finished:  # timed out or cancelled: take the whole check down, stragglers included
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    text = output.decode(errors="replace").strip()
    if proc.returncode == 0:
        return _passing(text)
    return _critical(_with_tail(f"exit code {proc.returncode}", text))


async def _read_tail(stream: asyncio.StreamReader) -> bytes:
    """Read to EOF keeping only the end: a chatty check must not grow the worker's memory."""
    kept = bytearray()
    while chunk := await stream.read(READ_CHUNK):
        kept += chunk
        del kept[: -MAX_OUTPUT * 4]
    return bytes(kept)


def _with_tail(prefix: str, text: str) -> str:
    """`prefix: <as much of the end of text as fits in MAX_OUTPUT>`."""
    if not text:
        return prefix
    room = MAX_OUTPUT - len(prefix) - 2
    return f"{prefix}: {text[-room:]}"
