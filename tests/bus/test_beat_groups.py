"""The workers bucket as a reader sees it (`bus.contract.beats.BeatGroups`): one update per worker, whether a worker
beat under its own key or with the other logical workers of its process under their group's key."""

from __future__ import annotations

import msgspec

from bus.contract import subjects
from bus.contract.beats import BeatGroups, WorkerBeats, member_beat
from bus.contract.codec import encode


def group(*members: str) -> bytes:
    return encode(WorkerBeats(beats={one: msgspec.Raw(encode({"worker_id": one})) for one in members}))


def beat(worker_id: str) -> bytes:
    return encode({"worker_id": worker_id})


def test_a_group_key_is_each_of_its_workers_and_its_expiry_each_ones_end() -> None:
    groups = BeatGroups()
    key = subjects.group_key("mad", "w0")
    assert key == "mad.w0.group" and subjects.is_group_key(key) and not subjects.is_group_key("mad.w0")
    assert groups.updates(key, group("w0", "w1", "w2")) == [
        ("mad.w0", beat("w0")),
        ("mad.w1", beat("w1")),
        ("mad.w2", beat("w2")),
    ]
    # a member left out of the group's next value is gone; a member carried unchanged is no update
    assert groups.updates(key, group("w0", "w2")) == [("mad.w1", None)]
    changed = encode(WorkerBeats(beats={"w0": msgspec.Raw(beat("w0")), "w2": msgspec.Raw(encode({"machines": 1}))}))
    assert groups.updates(key, changed) == [("mad.w2", encode({"machines": 1}))]
    # the key expires (or is deleted): each of its workers is gone
    assert groups.updates(key, None) == [("mad.w0", None), ("mad.w2", None)]
    assert groups.updates(key, None) == []
    # a worker's own key passes through as it is
    assert groups.updates("mad.w9", beat("w9")) == [("mad.w9", beat("w9"))]
    assert groups.updates("mad.w9", None) == [("mad.w9", None)]


def test_a_worker_belongs_to_the_key_that_beat_for_it_last() -> None:
    """A process restarted as a worker of its own (or into another group): the old key's end is not its end."""
    groups = BeatGroups()
    key = subjects.group_key("mad", "w0")
    groups.updates(key, group("w0", "w1"))
    assert groups.updates("mad.w1", beat("w1")) == [("mad.w1", beat("w1"))]
    assert groups.updates(key, None) == [("mad.w0", None)]  # w1 beats under its own key now
    groups.updates("mad.w5", beat("w5"))
    groups.updates(subjects.group_key("mad", "w4"), group("w4", "w5"))
    assert groups.updates("mad.w5", None) == []  # its old key expired; its group beats for it


def test_a_malformed_group_changes_nothing() -> None:
    groups = BeatGroups()
    key = subjects.group_key("mad", "w0")
    groups.updates(key, group("w0"))
    assert groups.updates(key, b"not json") == []
    assert groups.updates(key, None) == [("mad.w0", None)]


def test_one_workers_beat_in_a_group_is_the_bytes_its_own_key_would_hold() -> None:
    assert member_beat(group("w0", "w1"), "w1") == beat("w1")
    assert member_beat(group("w0"), "w1") is None
