"""The worker's tally, kept in step by its commit hook: ports held by machines not destroyed."""

from __future__ import annotations

from bus.contract.machines import Machine, MachineConfig
from workers.lifecycle.tally import MachineTally


def machine(machine_id: str, state: str, port: int | None) -> Machine:
    return Machine(
        id=machine_id,
        name=machine_id,
        app="web",
        region="mad",
        worker_id="w1",
        state=state,  # type: ignore[arg-type]
        config=MachineConfig(cmd=["true"]),
        instance_id="i",
        created_at="",
        updated_at="",
        port=port,
    )


def test_a_stopped_machine_keeps_its_port_held_and_a_destroyed_one_gives_it_back() -> None:
    tally = MachineTally([machine("a", "started", 20001), machine("b", "stopped", 20002)])
    assert 20001 in tally.ports and 20002 in tally.ports
    tally.update(machine("a", "stopped", 20001))
    tally.update(machine("a", "started", 20001))  # the same port again: held once
    tally.update(machine("b", "destroyed", 20002))
    assert 20001 in tally.ports and 20002 not in tally.ports
    tally.update(machine("a", "destroyed", 20001))
    assert not tally.ports


def test_two_machines_on_one_port_keep_it_held_until_both_are_gone() -> None:
    tally = MachineTally([machine("a", "stopped", 20001), machine("b", "stopped", 20001)])
    tally.update(machine("a", "destroyed", 20001))
    assert 20001 in tally.ports
    tally.update(machine("b", "destroyed", 20001))
    assert 20001 not in tally.ports
