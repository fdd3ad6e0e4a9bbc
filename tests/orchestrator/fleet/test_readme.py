"""The README's first hour runs as written: `fauxmad dev` in one terminal, the listed commands in another,
then `fauxmad proxy` in a third and the edge's commands (its port swapped for a free one).

The blocks are read from README.md itself, so the documentation cannot drift from what works; the hints
`fauxmad dev` prints are run verbatim too. The transcript is printed (`pytest -s`) for the notes.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bus.local.ports import free_port
from tests.helpers import ROOT

README = ROOT / "README.md"


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def first_hour_blocks(text: str | None = None) -> tuple[str, list[str], str, list[str]]:
    """The first hour's four blocks: `fauxmad dev`, the commands, `fauxmad proxy`, the edge's commands."""
    text = README.read_text() if text is None else text
    section = text.split("## The first hour", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 4, blocks
    return blocks[0].strip(), commands(blocks[1]), blocks[2].strip(), commands(blocks[3])


def shell_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {k: v for k, v in os.environ.items() if k != "FAUXMAD_NATS_URL"}
    return dict(env, PATH=path, PYTHONPATH=str(ROOT), COLUMNS="120", **extra)


ENDED = "\x00the output ended\x00"  # put by `lines_of` after the last line (compared by identity)


def lines_of(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """The process's output lines as they come (a thread reads: select on a buffered pipe can miss them)."""
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)
        out.put(ENDED)

    threading.Thread(target=pump, daemon=True).start()
    return out


def read_until(lines: queue.Queue[str], pattern: str, timeout: float) -> str:
    """The output up to `pattern`; fails once `timeout` passes, or at once when the output ends without it."""
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is ENDED:
            lines.put(ENDED)  # for the next reader too
            raise AssertionError(f"no {pattern!r}: the output ended; saw:\n{seen}")
        seen += line
        if re.search(pattern, seen):
            return seen
    raise AssertionError(f"no {pattern!r} within {timeout}s; saw:\n{seen}")


def run_lines(lines: list[str], env: dict[str, str], transcript: list[str]) -> list[str]:
    """Each line in its own shell, as a user would paste it; every one must exit 0. Their stdouts."""
    outs = []
    for line in lines:
        result = subprocess.run(
            ["bash", "-c", line], capture_output=True, text=True, timeout=180, env=env, cwd=str(ROOT)
        )
        transcript.append(f"$ {line}\n{result.stdout.rstrip()}\n{result.stderr.rstrip()}".rstrip())
        assert result.returncode == 0, "\n\n".join(transcript)
        outs.append(result.stdout)
    return outs


def start(line: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", "-c", f"exec {line}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(ROOT),
        start_new_session=True,
    )


def interrupt(proc: subprocess.Popen[str]) -> None:
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.timeout(540)
def test_the_first_hour_runs_as_written(tmp_path: Path) -> None:
    dev_line, lines, proxy_line, edge_lines = first_hour_blocks()
    env = shell_env(FAUXMAD_HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    dev = start(dev_line, env)
    proxy: subprocess.Popen[str] | None = None
    transcript = [f"$ {dev_line}"]
    try:
        seen = read_until(lines_of(dev), r"Ctrl-C stops everything", 90)
        transcript.append(seen.rstrip())
        hints = [
            line.strip()
            for line in seen.split("try, in another terminal:", 1)[1].splitlines()
            if line.strip().startswith(("export ", "fauxmad "))
        ]
        url = next(h.split("=", 1)[1] for h in hints if h.startswith("export "))
        fleet_env = dict(env, FAUXMAD_NATS_URL=url)
        # every hint `fauxmad dev` printed, then every line of the README, each as a user would paste it
        run_lines([h for h in hints if not h.startswith("export ")] + lines, fleet_env, transcript)
        # the edge, in a third terminal: the README's proxy on a free port instead of 8080
        port = f"127.0.0.1:{free_port()}"  # below the ephemeral range (bus.local.ports)
        assert "127.0.0.1:8080" in proxy_line and all("fauxmad proxy" not in line for line in edge_lines)
        proxy_line = proxy_line.replace("127.0.0.1:8080", port)
        proxy = start(proxy_line, fleet_env)
        transcript.append(f"$ {proxy_line}\n" + read_until(lines_of(proxy), r"listening on", 60).rstrip())
        outs = run_lines([line.replace("127.0.0.1:8080", port) for line in edge_lines], fleet_env, transcript)
        assert any('"sample": "python"' in out for out in outs), "\n\n".join(transcript)  # curl got the app
    finally:
        if proxy is not None:
            interrupt(proxy)
        interrupt(dev)
        print("\n\n".join(transcript))
    assert dev.returncode == 0


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.timeout(320)
def test_the_demo_runs_as_the_readme_says() -> None:
    first = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert first is not None
    install_and_demo = first.group(1).splitlines()[0]
    assert install_and_demo.endswith("&& fauxmad demo")  # the install itself is what CI just did
    result = subprocess.run(
        ["bash", "-c", "fauxmad demo"], capture_output=True, text=True, timeout=300, env=shell_env(), cwd=str(ROOT)
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
