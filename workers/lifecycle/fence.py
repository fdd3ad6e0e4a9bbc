"""The worker's side of the fence: a keyed machine reserved before an absence runs only if it is still the key's.

A broker that retries a create whose worker went silent does not wait for a worker whose heartbeat has
expired: it fences it in the key's claim and places a new machine id (bus/contract/idempotency.py). So a
worker that comes back from an absence (frozen, cut off, restarted) asks the claim of each keyed machine it
has not confirmed yet, before that machine runs: `ours` (the claim names it; settled on this worker with a
compare-and-set if it was not yet), `elsewhere` (destroyed without running) or `unknown` (the claims could
not be read: a just-reserved machine is then recorded failed rather than started; one found by a sweep stays
as it is until the next sweep, which comes with the next absence or restart, not on a timer).

"Away" is measured by the heartbeat: a machine must be checked when an absence began or ended since its
reserve arrived (`mark`), and a sweep runs after every absence and at start. Outside absences nothing is
asked: the create path costs one integer comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from bus.contract.idempotency import Claim, Verdict, settled_on, verdict
from workers.log.records import StoredMachine

log = logging.getLogger(__name__)

SETTLE_TRIES = 5  # compare-and-set races with a broker's fence: each loss re-reads the claim


class Claims(Protocol):
    """The key's claim where the worker's region keeps it (KV `fauxmad_idempotency`, or the region's own)."""

    async def read(self, app: str, key: str) -> tuple[Claim | None, int]: ...

    async def settle(self, app: str, key: str, claim: Claim, revision: int) -> bool: ...


class Fence:
    def __init__(
        self,
        claims: Claims,
        worker_id: str,
        *,
        absences: Callable[[], int],
        away: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self.claims = claims
        self.worker_id = worker_id
        self.absences = absences  # how many absences the heartbeat has seen end
        self.away = away  # whether one is going on now (no beat for longer than the registry allows)
        self.clock = clock
        self.confirmed: set[str] = set()  # keyed machines whose claim names them on this worker

    def mark(self) -> int:
        """Taken when a reserve arrives: `must_check` compares against it."""
        return self.absences()

    def must_check(self, stored: StoredMachine, mark: int) -> bool:
        if stored.idempotency_key is None or stored.machine.id in self.confirmed:
            return False
        return self.absences() != mark or self.away()

    async def verdict(self, stored: StoredMachine) -> Verdict:
        machine, key = stored.machine, stored.idempotency_key
        assert key is not None
        try:
            for _ in range(SETTLE_TRIES):
                claim, revision = await self.claims.read(machine.app, key)
                found = verdict(claim, machine.id, self.worker_id)
                if found is None:
                    assert claim is not None
                    settled = settled_on(claim, self.worker_id, self.clock())
                    if not await self.claims.settle(machine.app, key, settled, revision):
                        continue
                    found = "ours"
                if found == "ours":
                    self.confirmed.add(machine.id)
                else:
                    log.warning(
                        "machine %s: its key's claim names machine %s (fenced %s): not this worker's to run",
                        machine.id,
                        claim.machine_id if claim else None,
                        claim.fenced if claim else [],
                    )
                return found
        except Exception as exc:  # the claims cannot be read now: the next sweep asks again
            log.warning("machine %s: could not read its key's claim: %r", machine.id, exc)
        return "unknown"

    def unconfirmed(self, machines: Iterable[StoredMachine]) -> list[StoredMachine]:
        return [
            stored
            for stored in machines
            if stored.idempotency_key is not None
            and stored.machine.state != "destroyed"
            and stored.machine.id not in self.confirmed
        ]
