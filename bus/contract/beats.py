"""The workers bucket (`fauxmad_workers`) as every reader sees it: one heartbeat per worker.

A worker of its own (a real fleet: one worker a process) puts its `WorkerInfo` under its own key,
`<region>.<worker id>`, every interval. The logical workers of one process (`fauxmad worker --count`, a
benchmark's simulated fleet) put theirs together, in one value under one key a process (a `WorkerBeats` under
`subjects.group_key`), so that a fleet of 1,000 simulated workers costs nats-server and every watcher of the
bucket a put per process an interval, not one per worker. `BeatGroups` turns either kind of key back into one
update per worker, which is all a reader (a broker's registry, the status view, the operator) ever applies.
"""

from __future__ import annotations

import logging

import msgspec

from bus.contract import subjects

log = logging.getLogger(__name__)


class WorkerBeats(msgspec.Struct, kw_only=True):
    """A beat group's value (key `<region>.<first worker id>.group`, `subjects.group_key`): the heartbeats of
    logical workers that share a process (`fauxmad worker --count`, a benchmark's simulated fleet), each the very
    bytes its own key would hold (a `WorkerInfo`), by worker id. One put a process an interval instead of one a
    logical worker; a real fleet (one worker a process) never writes one."""

    beats: dict[str, msgspec.Raw] = {}


def member_beat(group: bytes, worker_id: str) -> bytes | None:
    """One worker's heartbeat (a `WorkerInfo`'s bytes) in a beat group's value, if it is there."""
    beat = msgspec.json.decode(group, type=WorkerBeats).beats.get(worker_id)
    return None if beat is None else bytes(beat)


class BeatGroups:
    """What a reader of the workers bucket sees: one update per worker, whichever kind of key said it.

    A worker's key (`<region>.<worker id>`) is passed on as it is. A beat group's key is expanded into an update
    of each member's key (`<region>.<member id>`, with its `WorkerInfo`'s bytes), and its deletion or expiry into
    the deletion of each member, so a dead process's logical workers disappear with its group's key, three
    intervals after its last beat, as a real worker's key does. A member missing from the group's next value is
    deleted too. A member the group's next value carries unchanged (the very bytes of its last update: a beat
    that carried another member's change) is no update at all, so a reader decodes only what changed (the
    group's beat every interval changes every member: their `heartbeat_at`). A worker belongs to the key that
    spoke for it last: a group's end does not delete a worker that a key of its own (or another group) has
    beaten since, nor the end of its own key one a group beats now."""

    def __init__(self) -> None:
        self._members: dict[str, dict[str, bytes]] = {}  # group key -> its members' keys and beats, as last put
        self._owner: dict[str, str] = {}  # worker key -> the key that last beat for it (its own, or a group's)

    def updates(self, key: str, value: bytes | None) -> list[tuple[str, bytes | None]]:
        """The per-worker updates one update of the bucket means (`value=None`: deleted or expired)."""
        if not subjects.is_group_key(key):
            if value is None:
                if self._owner.get(key, key) != key:
                    return []  # a group beats for it now
                self._owner.pop(key, None)
            else:
                self._owner[key] = key
            return [(key, value)]
        beats: dict[str, msgspec.Raw] = {}
        if value is not None:
            try:
                beats = msgspec.json.decode(value, type=WorkerBeats).beats
            except (msgspec.ValidationError, msgspec.DecodeError):
                log.warning("ignoring a malformed beat group under %s", key)
                return []
        before = self._members.pop(key, {})
        region = key.split(".", 1)[0]
        now = {subjects.worker_key(region, worker_id): bytes(beat) for worker_id, beat in beats.items()}
        out: list[tuple[str, bytes | None]] = []
        for member in before:
            if member not in now and self._owner.get(member) == key:
                del self._owner[member]
                out.append((member, None))
        for member, beat in now.items():
            if before.get(member) != beat or self._owner.get(member) != key:
                self._owner[member] = key
                out.append((member, beat))
        if now:
            self._members[key] = now
        return out
