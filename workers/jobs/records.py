"""Job records in KV `fauxmad_jobs`: read, create, and change with compare-and-set.

Every change is a pure function of the record as read (`Change`), retried on a revision conflict, so a
cancel and the worker running the job never overwrite each other: whichever writes second re-reads and
decides again. Reads and writes go through `bus.transport.jsfast` (they are made for every job); listing watches the
bucket through nats-py. NATS types stop here: callers get `Job` Structs.
"""

from __future__ import annotations

from collections.abc import Callable

from bus.contract import subjects
from bus.contract.codec import decode, encode
from bus.contract.errors import Conflict, NotFound
from bus.contract.jobs import Job
from bus.stores.kv_watch import current_values
from bus.transport.jsfast import FastKV, LostRace
from bus.transport.nats_adapter import KV

Change = Callable[[Job], Job | None]  # the new record, or None to leave it as it is

CAS_TRIES = 20


class JobRecords:
    def __init__(self, kv: KV, fast: FastKV) -> None:
        """`kv`: nats-py's handle of the bucket (for `list`); `fast`: the same bucket's reads and writes."""
        self.kv = kv
        self.fast = fast

    async def read(self, app: str, job_id: str) -> tuple[Job, int] | None:
        found = await self.fast.get(subjects.job_key(app, job_id))
        if found is None:
            return None
        value, revision = found
        return decode(Job, value), revision

    async def get(self, app: str, job_id: str) -> Job:
        found = await self.read(app, job_id)
        if found is None:
            raise NotFound(f"job {job_id} of app {app} not found")
        return found[0]

    async def create(self, job: Job) -> Job | None:
        """Store a new record; None if one is there already (a keyed submit sent again)."""
        if await self.fast.create(subjects.job_key(job.app, job.id), encode(job)) is None:
            return None
        return job

    async def change(self, app: str, job_id: str, change: Change, absent: Job | None = None) -> tuple[Job, bool]:
        """Apply `change` to the record with compare-and-set; (the record now, whether this call changed it)."""
        job, changed, _ = await self.change_from(app, job_id, change, absent=absent)
        return job, changed

    async def change_from(
        self, app: str, job_id: str, change: Change, known: tuple[Job, int] | None = None, absent: Job | None = None
    ) -> tuple[Job, bool, int]:
        """`change`, starting from `known` (a record and its revision, saving a read when it is current);
        (the record now, whether this call changed it, its revision). `absent`: the record as submitted, carried
        by the job's queue message: if the key has no value yet (the submit's write has not landed), the change
        is written as its first value (whoever writes first wins; the other re-reads and decides again)."""
        for _ in range(CAS_TRIES):
            found = known or await self.read(app, job_id)
            known = None
            if found is None and absent is not None:
                found = (absent, 0)  # revision 0: written only if the key has no value
            if found is None:
                raise NotFound(f"job {job_id} of app {app} not found")
            job, revision = found
            new = change(job)
            if new is None:
                return job, False, revision
            try:
                revision = await self.fast.update(subjects.job_key(app, job_id), encode(new), last=revision)
            except LostRace:
                continue
            return new, True, revision
        raise Conflict(f"job {job_id}: its record kept changing under {CAS_TRIES} tries")

    async def list(self, app: str) -> list[Job]:
        """Every record of `app`, as they are now (one watch, `current_values`)."""
        entries = await current_values(self.kv, f"{subjects.check_token('app', app)}.*", timeout=20.0)
        return [decode(Job, entry.value) for entry in entries if entry.value]
