"""The job reaper with real processes, no NATS: a killed watcher is replaced and told every job still running,
and the worker's end closing ends every job it lists (as a worker's death does)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import wait_until
from workers.jobs.reaper import Reaper


def _watchers() -> set[int]:
    """This process's reaper watchers (`python -S -c ...` children)."""
    me = str(Path("/proc/self").resolve().name)
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == me and b"-S\0-c\0" in cmdline:
            found.add(int(entry.name))
    return found


def _gone(proc: subprocess.Popen[bytes], within: float = 5.0) -> bool:
    try:
        proc.wait(within)
        return True
    except subprocess.TimeoutExpired:
        return False


@pytest.mark.fleet  # starts processes of its own
def test_a_killed_reaper_is_replaced_and_told_every_live_job() -> None:
    reaper = Reaper()
    first = subprocess.Popen(["sleep", "60"], start_new_session=True)
    second = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        reaper.watch(first.pid)
        (watcher,) = _watchers()
        subprocess.run(["kill", "-9", str(watcher)], check=True)
        # Its end of the pipe closed: only a zombie has closed its files (the kernel frees a dying process's
        # memory, and so its /proc cmdline, before its files: CI saw it gone from `_watchers` while the pipe
        # still had its reader, and the write went through). Waited for, not reaped: the reaper's Popen owns it.
        os.waitid(os.P_PID, watcher, os.WEXITED | os.WNOWAIT)
        reaper.watch(second.pid)  # the write finds the pipe closed: a new watcher, told of both
        # (its /proc cmdline shows `-S -c` once its exec has set up its arguments, a moment after Popen returns)
        wait_until(lambda: _watchers() - {watcher}, "a new watcher", 5)
        assert first.poll() is None and second.poll() is None  # nothing killed on the way
        reaper.close()  # as if the worker died: the watcher reads EOF
        assert _gone(first) and _gone(second), "a job outlived its worker's end of the reaper"
        assert not _watchers() - {watcher}
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


@pytest.mark.fleet  # starts processes of its own
def test_a_forgotten_job_is_left_alone() -> None:
    reaper = Reaper()
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        reaper.watch(job.pid)
        reaper.forget(job.pid)
        reaper.close()
        assert not _gone(job, within=0.5)
    finally:
        job.kill()
        job.wait()
