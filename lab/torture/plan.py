"""The seeded plans: the nemesis's fault schedule and each client's steps. Pure: no I/O, no clock.

Why it exists: a torture run must be replayable. Everything a run *attempts* is drawn here, from one
`random.Random` for the nemesis and one per client, all derived from the seed, and nothing else draws
from them: the same seed gives the same faults (kind, target, timing, whether it strikes on a reserve,
how long it holds) and the same client steps (kind, slot, region, lease holder and ttl, pauses), in the
same order. Every step draws the same number of values whatever its kind, so one step's kind never
shifts the next step's draws. What a step then does depends on what the fleet answered earlier (a stop
of an empty slot is skipped; a key whose create timed out is retried), and timings differ naturally.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import msgspec

FAULT_KINDS = ("kill", "freeze", "nats", "broker", "operator", "cpu")
GAP_S = 5.0  # the default least time between two faults' starts (the most: twice it)
STEP_KINDS = ("create", "start", "stop", "destroy", "lease", "lease_race", "replay")
STEP_WEIGHTS = (30, 12, 12, 10, 18, 6, 12)


class FaultStep(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # seconds after the workload starts (the earliest it may strike: faults never overlap)
    kind: str
    target: str  # a worker id, a broker's process name, "nats", "operator" or "host" (cpu: the whole host)
    hold: float  # seconds down (a kill's restart delay), frozen, or starved of CPU
    on_reserve: bool  # kill/freeze: strike the moment a reserve goes out to the target


class ClientStep(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    kind: str
    slot: int
    region: str
    holder: str  # lease: "a" or "b"
    ttl: float  # lease
    release: bool  # lease: release it before the step ends
    pause: float  # seconds before the next step


def _seed_of(seed: int, name: str) -> int:
    """A stable per-stream seed (Python's `hash` of a str changes per process)."""
    return seed * 1_000_003 + sum((i + 1) * ord(c) for i, c in enumerate(name))


def fault_schedule(
    seed: int,
    duration: float,
    kinds: Sequence[str],
    workers: Sequence[str],
    brokers: Sequence[str],
    gap: float = GAP_S,
) -> list[FaultStep]:
    """One fault every `gap` to 2 x `gap` seconds (5-10 s by default; the first after 3-6 s) until `duration`;
    kinds come from a shuffled bag of the enabled ones, so every kind appears once in each round of len(kinds)
    faults: a schedule of at least len(kinds) faults injects every kind, whatever the seed."""
    rng = random.Random(_seed_of(seed, "nemesis"))
    steps: list[FaultStep] = []
    at = rng.uniform(3.0, 6.0)
    bag: list[str] = []
    while at < duration and kinds:
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        kind = bag.pop()
        worker = rng.choice(list(workers))
        broker = rng.choice(list(brokers))
        on_reserve = rng.random() < 0.5
        hold = {
            "kill": rng.uniform(1.0, 4.0),
            "freeze": rng.uniform(3.0, 8.0),
            "nats": rng.uniform(1.0, 3.0),
            "broker": rng.uniform(0.5, 2.0),
            "operator": rng.uniform(0.5, 2.0),
            "cpu": rng.uniform(3.0, 8.0),
        }[kind]
        target = {
            "kill": worker,
            "freeze": worker,
            "nats": "nats",
            "broker": broker,
            "operator": "operator",
            "cpu": "host",
        }[kind]
        steps.append(
            FaultStep(
                at=round(at, 3),
                kind=kind,
                target=target,
                hold=round(hold, 3),
                on_reserve=on_reserve and kind in ("kill", "freeze"),
            )
        )
        at += rng.uniform(gap, 2 * gap)
    return steps


def client_steps(seed: int, client: str, regions: Sequence[str], slots: int) -> Iterator[ClientStep]:
    """A client's endless, seeded sequence of steps."""
    rng = random.Random(_seed_of(seed, client))
    index = 0
    while True:
        kind = rng.choices(STEP_KINDS, weights=STEP_WEIGHTS)[0]
        slot = rng.randrange(slots)
        region = rng.choice(list(regions))
        holder = rng.choice(("a", "b"))
        ttl = round(rng.uniform(0.5, 2.5), 3)
        release = rng.random() < 0.6
        pause = round(rng.uniform(0.05, 0.5), 3)
        yield ClientStep(
            index=index, kind=kind, slot=slot, region=region, holder=holder, ttl=ttl, release=release, pause=pause
        )
        index += 1
