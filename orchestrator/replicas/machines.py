"""Which worker owns a machine: a local replica of KV `fauxmad_machines`, kept current by a watch.

Workers write the index after each transition; a broker that routes `get`, `stop` and friends
reads its replica (no network hop), falling back to a direct KV read for a machine created a moment
ago on another broker. Machines never move between workers, so an answer never goes stale except
by destruction, which the watch delivers. Reconcilers read it for the machines of workers whose
heartbeat expired (nobody is left to ask about them).
"""

from __future__ import annotations

import asyncio
import logging

from bus.contract.codec import decoder
from bus.contract.errors import NotFound
from bus.contract.machines import MachineIndexEntry
from orchestrator.replicas.replica import KVReplica

log = logging.getLogger(__name__)


class MachineIndex(KVReplica):
    def __init__(self) -> None:
        super().__init__()
        self._entries: dict[str, MachineIndexEntry] = {}

    def apply(self, key: str, value: bytes | None) -> None:
        if value is None:
            self._entries.pop(key, None)
            return
        try:
            self._entries[key] = decoder(MachineIndexEntry).decode(value)
        except Exception:
            log.warning("index: ignoring malformed entry %s", key)

    def remember(self, entry: MachineIndexEntry) -> None:
        self._entries[entry.id] = entry

    def get(self, machine_id: str) -> MachineIndexEntry | None:
        return self._entries.get(machine_id)

    def by_app(self, app: str) -> list[MachineIndexEntry]:
        return [entry for entry in self._entries.values() if entry.app == app]

    def apps(self) -> set[str]:
        return {entry.app for entry in self._entries.values()}

    async def locate(self, machine_id: str, app: str | None = None) -> MachineIndexEntry:
        entry = self._entries.get(machine_id)
        if entry is None and self._kv is not None:
            for _ in range(5):  # created a moment ago through another broker: the index may lag
                try:
                    found = await self._kv.get(machine_id)
                    entry = decoder(MachineIndexEntry).decode(found.value or b"")
                    self._entries[machine_id] = entry
                    break
                except Exception:
                    await asyncio.sleep(0.02)
        if entry is None or (app is not None and entry.app != app):
            raise NotFound(f"machine {machine_id} not found" + (f" in app {app}" if app else ""))
        return entry
