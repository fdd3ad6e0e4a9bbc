"""`fauxmad dev --supercluster` as the README shows it: its lighter lines (open, then secure) run verbatim, then
the hints each prints (every command from a shell in the first region, reaching the fleet), then Ctrl-C stops
everything."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.orchestrator.fleet.test_readme import lines_of, read_until, shell_env


def readme_lines() -> list[str]:
    section = (
        (ROOT / "docs" / "how-to" / "supercluster.md")
        .read_text()
        .split("## Beyond one server: a supercluster", 1)[1]
        .split("\n## ", 1)[0]
    )
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    return [line for line in block.splitlines() if line.strip()]


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["open", "secure"])
def test_the_light_dev_supercluster_runs_as_written(tmp_path: Path, which: str) -> None:
    full, open_light, secure_light = readme_lines()
    assert full.startswith("fauxmad dev --supercluster ") and "--secure" in secure_light
    light = open_light if which == "open" else secure_light
    env = shell_env(FAUXMAD_HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"))
    dev = subprocess.Popen(
        ["bash", "-c", f"exec {light}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(ROOT),
        start_new_session=True,
    )
    transcript = [f"$ {light}"]
    output = lines_of(dev)
    try:
        seen = read_until(output, r"Ctrl-C stops everything", 150)
        transcript.append(seen.rstrip())
        scheme = "tls" if which == "secure" else "nats"
        assert re.search(rf"mad: {scheme}://127\.0\.0\.1:\d+\n", seen) and "an operator per region" in seen
        hints = [
            line.strip()
            for line in seen.split("try, in another terminal:", 1)[1].splitlines()
            if line.strip().startswith(("export ", "fauxmad "))
        ]
        exports = dict(h.removeprefix("export ").split("=", 1) for h in hints if h.startswith("export "))
        assert exports["FAUXMAD_SUPERCLUSTER"] == "mad,syd,gru"
        if which == "secure":  # without the operator's credentials the fleet refuses, in one line
            bare = {k: v for k, v in exports.items() if k != "FAUXMAD_CREDS"}
            refused = subprocess.run(
                ["bash", "-c", "fauxmad workers"], capture_output=True, text=True, timeout=60, env=dict(env, **bare)
            )
            assert refused.returncode != 0 and "is a secure fleet: set FAUXMAD_CREDS" in refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        for line in [h for h in hints if not h.startswith("export ")] + ["fauxmad status", "fauxmad regions"]:
            result = subprocess.run(
                ["bash", "-c", line],
                capture_output=True,
                text=True,
                timeout=120,
                env=dict(env, **exports),
                cwd=str(ROOT),
            )
            transcript.append(f"$ {line}\n{result.stdout.rstrip()}\n{result.stderr.rstrip()}".rstrip())
            assert result.returncode == 0, "\n\n".join(transcript)
        assert all(region in transcript[-1] for region in ("mad", "syd", "gru"))
    finally:
        os.killpg(dev.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        try:
            dev.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(dev.pid, signal.SIGKILL)
            dev.wait()
        print("\n\n".join(transcript))
    assert dev.returncode == 0
    stopped = read_until(output, r"nothing left running", 10)
    assert "Traceback" not in stopped, stopped
