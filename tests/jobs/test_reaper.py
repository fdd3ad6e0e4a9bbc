"""The job reaper with real processes, no NATS: a killed watcher is replaced and told every job still running,
and the worker's end closing ends every job it lists (as a worker's death does)."""

from __future__ import annotations

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
        wait_until(lambda: watcher not in _watchers(), "the killed watcher gone (its end of the pipe closed)", 5)
        reaper.watch(second.pid)  # the write finds the pipe closed: a new watcher, told of both
        assert _watchers() - {watcher}, "no new watcher"
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
