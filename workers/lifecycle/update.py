"""Update: a machine's new config (and instance id), checked and recorded; a running machine is replaced.

An update of a running machine takes two commits around a stop: `replacing` (so nothing else starts it
meanwhile), then the new config and `starting`, after which the manager launches it. A change to labels
only (metadata, standbys: a running process never sees them) is recorded in place, without a restart.
This module holds the checks and the transactions; the manager holds the lock, the stop and the launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from bus.contract.errors import BadRequest, Conflict, NoCapacity
from bus.contract.machines import MachineConfig, UpdateRequest
from workers.driver import sandbox
from workers.lifecycle import leases
from workers.lifecycle.config import ManagerConfig
from workers.lifecycle.launch_spec import check_workdir
from workers.lifecycle.recorder import Recorder
from workers.log.records import StoredMachine
from workers.log.stamps import new_instance_id
from workers.log.store import Tx

UNUPDATABLE = ("destroying", "destroyed", "stopping", "replacing")


def check(request: UpdateRequest, worker_id: str) -> None:
    """What an update is refused for before any commit: no command, no such workdir or sandbox here."""
    request.config.require_command()
    check_workdir(request.config, worker_id)
    try:
        sandbox.check(request.config.guest.sandbox, worker_id)
    except sandbox.SandboxUnavailable as exc:
        raise BadRequest(str(exc)) from None


def op(request: UpdateRequest, config: ManagerConfig, recorder: Recorder) -> Callable[[Tx], tuple[StoredMachine, bool]]:
    """The first transaction: (the machine, whether it runs and must now be replaced)."""

    def update(tx: Tx) -> tuple[StoredMachine, bool]:
        stored = tx.require(request.id)
        leases.check(stored, request.lease_nonce, tx.now)
        state = stored.machine.state
        if state in UNUPDATABLE:
            raise Conflict(f"machine {request.id} is {state}; it cannot be updated now")
        if request.config.mounts != stored.machine.config.mounts:
            raise Conflict("config.mounts cannot change in an update: a volume stays with its machine")
        old, new = stored.machine.config.guest, request.config.guest
        usage = tx.usage()
        if usage.cpus - old.cpus + new.cpus > config.cpus or (
            usage.memory_mb - old.memory_mb + new.memory_mb > config.memory_mb
        ):
            raise NoCapacity(f"worker {config.worker_id} has no room for the new guest size")
        running = state in ("started", "starting")
        if running and only_labels_differ(stored.machine.config, request.config):
            # metadata and standbys label a machine; changing them needs no new instance
            stored.machine.config = request.config
            recorder.event(
                stored, "update", source="user", reason="metadata updated in place (no restart)", kind="update"
            )
            return tx.put_machine(stored, "update"), False
        if running:
            recorder.event(stored, "replacing", source="user", reason="update requested")
        else:
            apply_config(stored, request, tx.now, recorder)
        return tx.put_machine(stored, "update" if not running else "replacing"), running

    return update


def restart_op(request: UpdateRequest, recorder: Recorder) -> Callable[[Tx], StoredMachine]:
    """The second transaction, once the old process is stopped: the new config, `starting`."""

    def restart(tx: Tx) -> StoredMachine:
        current = tx.require(request.id)
        apply_config(current, request, tx.now, recorder)
        current.handle = None
        current.restart_attempts = 0
        current.desired = "started"
        recorder.event(current, "starting", reason="starting the updated config")
        return tx.put_machine(current, "update")

    return restart


def apply_config(stored: StoredMachine, request: UpdateRequest, now: float, recorder: Recorder) -> None:
    stored.machine.config = request.config
    stored.machine.instance_id = new_instance_id(now)
    stored.machine.checks = {}
    recorder.event(
        stored,
        "update",
        source="user",
        reason=f"config updated (instance {stored.machine.instance_id})",
        kind="update",
    )


def only_labels_differ(old: MachineConfig, new: MachineConfig) -> bool:
    """True when two configs differ at most in `metadata` and `standbys`, which a running process never sees."""
    unlabel: dict[str, Any] = {"metadata": {}, "standbys": []}
    return msgspec.structs.replace(old, **unlabel) == msgspec.structs.replace(new, **unlabel)
