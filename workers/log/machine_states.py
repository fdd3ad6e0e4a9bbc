"""The machine lifecycle as an explicit table of legal transitions.

Every state change a worker makes goes through `check_transition`, so an illegal request (start a
destroyed machine, destroy one that is stopping) is a 409 naming both states, and no code path can
invent a transition the table does not allow. `replacing` is the state an update passes through.
"""

from __future__ import annotations

from bus.contract.errors import Conflict

LEGAL: dict[str, frozenset[str]] = {
    "created": frozenset({"starting", "destroying", "replacing"}),
    # starting -> destroying: a forced destroy during a restart's back-off (no process runs then)
    "starting": frozenset({"started", "stopping", "failed", "destroying", "replacing"}),
    # started -> starting is the supervisor restarting a machine whose process exited
    "started": frozenset({"stopping", "stopped", "failed", "starting", "destroying", "replacing", "suspending"}),
    # suspend: the process group is frozen (SIGSTOP) and continued (SIGCONT) by `resume`; it may still
    # exit (killed from outside), be stopped or be destroyed like a started machine
    "suspending": frozenset({"suspended", "started", "stopping", "stopped", "failed", "starting", "destroying"}),
    "suspended": frozenset({"started", "stopping", "stopped", "failed", "starting", "destroying"}),
    "stopping": frozenset({"stopped", "failed", "destroying"}),
    "stopped": frozenset({"starting", "destroying", "replacing"}),
    "failed": frozenset({"starting", "destroying", "replacing"}),
    "replacing": frozenset({"starting", "created", "stopped", "failed"}),
    "destroying": frozenset({"destroyed"}),
    "destroyed": frozenset(),
}

# States in which the machine's process may be running (the driver must be asked).
PROCESS_STATES = frozenset({"starting", "started", "stopping", "replacing", "destroying", "suspending", "suspended"})
# States from which `start` launches the machine.
STARTABLE = frozenset({"created", "stopped", "failed"})
# A machine holds its reservation (cpus, memory) in every state but destroyed.
HOLDS_RESOURCES = frozenset(LEGAL) - {"destroyed"}


def can_transition(current: str, target: str) -> bool:
    return target in LEGAL.get(current, frozenset())


def check_transition(machine_id: str, current: str, target: str) -> None:
    if not can_transition(current, target):
        raise Conflict(f"machine {machine_id} is {current}; it cannot become {target}")
