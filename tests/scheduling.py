"""Which test file an xdist worker runs next under `--dist loadfile` (`just test`, CI): the longest first.

xdist's own order is by the number of tests in a file, most first. The suite's longest files have few tests
(`tests/hosts/test_torture_on_hosts.py`: two, three minutes), so they came last, and one worker ran them
alone while the other had finished: the run's tail. Longest first (with the files' times measured in a CI
run, `SECONDS`) leaves the short files for the end, where they fill both workers' time evenly.

xdist also hands a worker its next file while two of its tests are still to run; behind a file of two long
tests that next file waited minutes while the other worker was idle. Here a worker is handed its next file
when one test of its current file is left (xdist's worker holds its last test back until it knows the one
after it, so it cannot be fewer).

The times only order the files: a file missing from `SECONDS` (a new one) counts a fifth of a second a test,
and a wrong time makes the run slower, never different.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

# seconds each file took (setup, calls and teardown) in a CI run at two files at a time; files under 10 s left out
SECONDS: dict[str, float] = {}
UNKNOWN_PER_TEST = 0.2


class LongestFirst(LoadFileScheduling):
    """`--dist loadfile`, with the longest file handed out first and no file waiting behind a long one."""

    def _cost(self, scope: str) -> float:
        return SECONDS.get(scope, UNKNOWN_PER_TEST * len(self.workqueue[scope]))

    def _assign_work_unit(self, node: WorkerController) -> None:
        self.workqueue.move_to_end(max(self.workqueue, key=self._cost), last=False)
        super()._assign_work_unit(node)

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
