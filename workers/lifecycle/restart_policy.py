"""Local supervision decisions: what happens after a machine's process exits. Pure functions.

The worker, not a central scheduler, decides restarts (as flyd does): the policy is the machine's,
the facts are local, and the answer must not wait for the network. Back-off doubles from a base to
a cap; a run that lasted longer than `stable_after` counts as healthy and resets the attempt count,
so a machine that crashes once a day is not eventually given up on.
"""

from __future__ import annotations

import msgspec

from bus.contract.machines import RestartPolicy
from workers.driver.base import ExitStatus

DEFAULT_ON_FAILURE_RETRIES = 10

# `ExitInfo.stderr_tail`: the last lines a process wrote to stderr, read from the end of its log file
STDERR_TAIL_LINES = 20
STDERR_TAIL_WIDTH = 300  # characters per line, after which a line is cut and marked
STDERR_TAIL_BYTES = 8192  # how much of the end of the file is read: bounded, whatever the file's size


class Backoff(msgspec.Struct, frozen=True, kw_only=True):
    base: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    stable_after: float = 60.0

    def delay(self, attempt: int) -> float:
        """Delay before restart number `attempt` (0-based)."""
        return float(min(self.cap, self.base * self.factor ** max(0, attempt)))


class AfterExit(msgspec.Struct, frozen=True, kw_only=True):
    """The decision: restart after `delay` (attempt number `attempt`), or settle in `state`."""

    restart: bool
    state: str
    attempt: int = 0
    delay: float = 0.0
    reason: str = ""


def describe_exit(status: ExitStatus) -> str:
    if status.oom_killed:
        return "killed: out of memory"
    if status.lost:
        return "exited while the worker was down; status lost"
    if status.signal is not None:
        return f"killed by signal {status.signal}"
    return f"exited with code {status.exit_code}"


def after_exit(
    policy: RestartPolicy,
    status: ExitStatus,
    *,
    attempts: int,
    ran_for: float,
    requested_stop: bool,
    backoff: Backoff,
) -> AfterExit:
    """Decide what a machine whose process just ended becomes."""
    settled = "stopped" if status.success or requested_stop else "failed"
    reason = describe_exit(status)
    if requested_stop:
        return AfterExit(restart=False, state="stopped", reason=f"stopped on request ({reason})")
    if ran_for >= backoff.stable_after:
        attempts = 0
    wants_restart = policy.policy == "always" or (policy.policy == "on-failure" and not status.success)
    if not wants_restart:
        return AfterExit(restart=False, state=settled, reason=reason)
    limit = policy.max_retries
    if limit is None and policy.policy == "on-failure":
        limit = DEFAULT_ON_FAILURE_RETRIES
    if limit is not None and attempts >= limit:
        return AfterExit(restart=False, state=settled, reason=f"{reason}; gave up after {attempts} restarts")
    return AfterExit(
        restart=True,
        state="starting",
        attempt=attempts + 1,
        delay=backoff.delay(attempts),
        reason=f"{reason}; restart {attempts + 1} in {backoff.delay(attempts):.2f}s",
    )


def tail_lines(
    data: bytes, *, whole: bool, lines: int = STDERR_TAIL_LINES, width: int = STDERR_TAIL_WIDTH
) -> list[str]:
    """The last `lines` lines of `data` (the end of a log file), each at most `width` characters.

    `whole`: `data` starts at the beginning of the file; if not, its first line is probably a piece of
    a longer one and is dropped (unless it is all there is). Bytes that are not UTF-8 are replaced, a
    carriage return ends a line too (progress bars), and blank lines at the end are left out.
    """
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    split = text.split("\n")
    if not whole and len(split) > 1:
        split = split[1:]
    while split and not split[-1].strip():
        split.pop()
    return [line if len(line) <= width else line[: width - 1] + "…" for line in split[-lines:]]
