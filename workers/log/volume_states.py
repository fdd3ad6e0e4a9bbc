"""The volume lifecycle as an explicit table of legal transitions (flyd's other state machine).

`creating` is recorded before the worker makes the volume's filesystem (and restores a snapshot into
it), `destroying` before it removes the data, so a worker killed in between finds the volume there on
restart and finishes the job from the log. `attached` names the one machine that holds it; the machine
reserve that attaches it and the machine destroy that detaches it commit the volume's record in the
same transaction as the machine's. Everything else is a 409 naming both states.
"""

from __future__ import annotations

from bus.contract.errors import Conflict

VOLUME_LEGAL: dict[str, frozenset[str]] = {
    "creating": frozenset({"created", "destroying"}),  # destroying: a restore that cannot finish
    "created": frozenset({"attached", "destroying"}),
    "attached": frozenset({"created"}),  # detached when its machine is destroyed
    "destroying": frozenset({"destroyed"}),
    "destroyed": frozenset(),
}
# A volume holds its size of the worker's volume capacity in every state but destroyed.
VOLUME_HOLDS = frozenset(VOLUME_LEGAL) - {"destroyed"}
# States whose data is on disk and usable (mounted, for a loop image).
VOLUME_READY = frozenset({"created", "attached"})


def check_volume_transition(volume_id: str, current: str, target: str) -> None:
    if target not in VOLUME_LEGAL.get(current, frozenset()):
        raise Conflict(f"volume {volume_id} is {current}; it cannot become {target}")
