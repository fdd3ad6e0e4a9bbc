"""Reservation: whether this worker takes a machine, and the record that holds its place.

A reserve is the one commit that makes a machine this worker's (and its volumes), so everything that could
make it wrong is checked inside that commit: an expired reserve (the broker has moved on), a cordon, a
clock too far off, no room. A retry of the same reserve (a broker's, or an idempotency key's) answers with
the machine already recorded instead of making a second one. The manager commits the transaction and
starts the machine when the reserve asks for it.
"""

from __future__ import annotations

from collections.abc import Callable

from bus.contract.errors import BadRequest, Conflict, DeadlineExceeded, NoCapacity
from bus.contract.machines import Machine, MachineEvent, ReserveRequest
from workers.driver import sandbox
from workers.lifecycle.config import ManagerConfig
from workers.lifecycle.launch_spec import check_workdir
from workers.lifecycle.recorder import Recorder
from workers.log.records import PendingAudit, StoredMachine
from workers.log.stamps import iso, new_instance_id
from workers.log.store import Tx
from workers.volumes.verbs import attach


class Reservations:
    def __init__(self, config: ManagerConfig, recorder: Recorder, skewed: Callable[[], str | None]) -> None:
        self.config = config
        self.recorder = recorder
        self.skewed = skewed  # why this worker's clock is too far off to reserve anything (its heartbeat measures)

    def check(self, request: ReserveRequest) -> None:
        """What a reserve is refused for before any commit: another region, no command, no such workdir or sandbox
        here."""
        if request.region != self.config.region:
            raise BadRequest(f"worker {self.config.worker_id} is in region {self.config.region}, not {request.region}")
        request.config.require_command()
        check_workdir(request.config, self.config.worker_id)
        try:
            sandbox.check(request.config.guest.sandbox, self.config.worker_id)
        except sandbox.SandboxUnavailable as exc:  # a refusal: the broker moves on to a worker that has it
            raise NoCapacity(str(exc)) from None

    def op(self, request: ReserveRequest, machine_id: str, port: int) -> Callable[[Tx], tuple[StoredMachine, bool]]:
        """The reserve's transaction: (the machine, whether this commit reserved it)."""

        def op(tx: Tx) -> tuple[StoredMachine, bool]:
            if request.idempotency_key:
                existing = tx.by_idempotency(request.idempotency_key)
                # the key's machine here, if this reserve is for it: not another app's that used the same key,
                # nor a copy the key's claim fenced off (the reserve then names the key's newer machine id)
                if existing is not None and same_reservation(existing, request):
                    return existing, False
            held = tx.get(machine_id)
            if held is not None:
                if held.machine.app != request.app or held.idempotency_key != request.idempotency_key:
                    raise Conflict(f"machine {machine_id} exists already")
                return held, False  # the same reservation again (a broker's retry or probe): answer with it
            self.check_room(tx, request, machine_id)
            stored = self.new_record(request, machine_id, port, tx.now)
            attach(tx, stored.machine)  # its volumes are its own from this commit on, or nothing is reserved
            if request.launch:
                self.recorder.event(stored, "starting", source="user", reason="start requested")
                stored.desired = "started"
            stored = tx.put_machine(stored, "reserve")
            if request.audit is not None:  # a create through the brokers: its record goes to the audit stream too
                made = stored.machine
                tx.keep_audit(PendingAudit(seq=made.version, app=made.app, machine_id=made.id, record=request.audit))
            return stored, True

        return op

    def check_room(self, tx: Tx, request: ReserveRequest, machine_id: str) -> None:
        """Refuse a reserve this worker must not commit: expired, cordoned, or no room (all in the commit)."""
        skewed = self.skewed()
        if skewed is not None:  # its clock decides whether a reserve expired: with it off, nothing is safe
            raise NoCapacity(skewed)
        if request.expires_at is not None and tx.now > request.expires_at:
            # the broker has given up on this reserve and may place elsewhere: never commit it late
            raise DeadlineExceeded(f"reservation of {machine_id} expired before it was committed: nothing reserved")
        if tx.worker().cordoned:
            raise NoCapacity(f"worker {self.config.worker_id} is cordoned")
        guest = request.config.guest
        usage = tx.usage()
        if usage.cpus + guest.cpus > self.config.cpus or usage.memory_mb + guest.memory_mb > self.config.memory_mb:
            raise NoCapacity(
                f"worker {self.config.worker_id} is full: needs {guest.cpus} cpus/{guest.memory_mb} MB, "
                f"{self.config.cpus - usage.cpus} cpus/{self.config.memory_mb - usage.memory_mb} MB free"
            )

    def new_record(self, request: ReserveRequest, machine_id: str, port: int, now: float) -> StoredMachine:
        """A reserved machine (`created`) with its first event, which keeps the placement's explanation."""
        stamp = iso(now)
        instance_id = new_instance_id(now)
        stored = StoredMachine(
            machine=Machine(
                id=machine_id,
                name=request.name or f"{request.app}-{machine_id[:6]}",
                app=request.app,
                region=request.region,
                worker_id=self.config.worker_id,
                state="created",
                config=request.config,
                instance_id=instance_id,
                created_at=stamp,
                updated_at=stamp,
                port=port,
                address=self.config.address,
            ),
            idempotency_key=request.idempotency_key,
        )
        stored.events.append(
            MachineEvent(
                type="transition",
                status="created",
                source="user",
                reason="reserved",
                timestamp=round(now * 1000, 3),
                machine_id=machine_id,
                app=request.app,
                region=request.region,
                worker_id=self.config.worker_id,
                metadata=dict(request.config.metadata),
                instance_id=instance_id,
                placement=request.placement,
                audit=request.audit,
            )
        )
        return stored


def same_reservation(existing: StoredMachine, request: ReserveRequest) -> bool:
    """The key's machine is this reserve's: the same app, and the id the reserve names, if it names one."""
    return existing.machine.app == request.app and request.id in (None, existing.machine.id)
