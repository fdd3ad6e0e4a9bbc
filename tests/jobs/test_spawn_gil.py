"""Why a fast-path job's `posix_spawn` is called on the event loop (`workers/jobs/spawn.py`): CPython's
`os.posix_spawnp` keeps the GIL while the parent waits for the child's exec, so a thread would not let the loop
go on, and would only add a hop there and back. If an interpreter lets the GIL go, this fails: a thread may
then pay, under load (measure it with `fauxmad bench jobs --against`)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path


def test_posix_spawnp_keeps_the_gil_while_the_child_is_held_before_its_exec(tmp_path: Path) -> None:
    fifo, released = tmp_path / "fifo", tmp_path / "released"
    os.mkfifo(fifo)
    # the child opens the fifo before its exec, and is held there until another process opens it for writing:
    # that one marks the release first, so the mark is there before posix_spawnp can return
    opener = subprocess.Popen(["sh", "-c", f"sleep 0.5; touch '{released}'; exec 3>'{fifo}'; sleep 0.2"])
    pids: list[int] = []
    calling = threading.Event()

    def spawner() -> None:
        calling.set()
        actions = [(os.POSIX_SPAWN_OPEN, 3, str(fifo), os.O_RDONLY, 0)]
        pids.append(os.posix_spawnp("true", ["true"], dict(os.environ), file_actions=actions))

    thread = threading.Thread(target=spawner)
    thread.start()
    assert calling.wait(10)
    time.sleep(0.05)  # the spawner is in posix_spawnp now, its child held before its exec
    released_when_this_ran = released.exists()  # this thread's Python runs again only once the GIL is let go
    thread.join(10)
    opener.wait(10)
    os.waitpid(pids[0], 0)
    assert released_when_this_ran, "the main thread ran while posix_spawnp waited for its child: the GIL was let go"
