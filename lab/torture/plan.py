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
# on hosts of their own (`fauxmad torture --hosts`): a host's link cut both ways, its outgoing packets dropped, its
# link flapping, its link slowed (a latency spike), a worker restarted under a skewed clock; and in a supercluster
# a region cut from the others (its gateways)
HOST_FAULT_KINDS = ("cut", "oneway", "flap", "latency", "skew")
REGION_FAULT_KINDS = ("region",)
ALL_FAULT_KINDS = FAULT_KINDS + HOST_FAULT_KINDS + REGION_FAULT_KINDS
PARTITIONS = frozenset({"cut", "oneway", "flap", "region"})  # the faults that split the fleet in two sides
SKEWS = ("+3s", "-30s")  # a skew fault's offsets: past the 0.25 s the fleet tolerates, both ways (test_skew's)
STEP_KINDS = ("create", "start", "stop", "destroy", "lease", "lease_race", "replay")
STEP_WEIGHTS = (30, 12, 12, 10, 18, 6, 12)


class FaultStep(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # seconds after the workload starts (the earliest it may strike: faults never overlap)
    kind: str
    target: str  # a worker id, a broker's process name, "nats", "operator", a host, a region, or "host" (cpu)
    hold: float  # seconds down (a kill's restart delay), frozen, cut, or starved of CPU
    on_reserve: bool  # kill/freeze: strike the moment a reserve goes out to the target
    skew: str = ""  # skew: the clock offset the worker runs under ("+3s", "-30s")


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
    *,
    hosts: Sequence[str] = (),
    regions: Sequence[str] = (),
    servers: Sequence[str] = (),
    operators: Sequence[str] = (),
    gap: float = GAP_S,
) -> list[FaultStep]:
    """One fault every `gap` to 2 x `gap` s (5-10 s by default; the first after 3-6 s) until `duration`; kinds
    come from a shuffled bag of the enabled ones, so every kind appears once in each round of len(kinds) faults,
    and the first round is always scheduled whole, even past `duration`: every enabled kind strikes at least
    once per run.

    `hosts`, `regions`: the targets of the host faults and of a region cut; `servers`: the nats-servers a `nats`
    fault picks from (default: the one, target "nats"); `operators`: the operator processes (default "operator").
    A run on one host draws exactly what it drew before these existed (the same seed, the same schedule)."""
    rng = random.Random(_seed_of(seed, "nemesis"))
    steps: list[FaultStep] = []
    at = rng.uniform(3.0, 6.0)
    bag: list[str] = []
    while (at < duration or len(steps) < len(kinds)) and kinds:
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        kind = bag.pop()
        worker = rng.choice(list(workers))
        broker = rng.choice(list(brokers))
        on_reserve = rng.random() < 0.5
        holds = {  # every one drawn whatever the kind, so one kind never shifts the next fault's draws
            "kill": rng.uniform(1.0, 4.0),
            "freeze": rng.uniform(3.0, 8.0),
            "nats": rng.uniform(1.0, 3.0),
            "broker": rng.uniform(0.5, 2.0),
            "operator": rng.uniform(0.5, 2.0),
        }
        if "cpu" in kinds:  # drawn only when enabled: a schedule without it is the one drawn before it existed
            holds["cpu"] = rng.uniform(3.0, 8.0)
        target = {
            "kill": worker,
            "freeze": worker,
            "nats": "nats",
            "broker": broker,
            "operator": "operator",
            "cpu": "host",
        }.get(kind, "")
        skew = ""
        if hosts or regions or servers or operators:  # drawn only on hosts: a one-host run's draws stay as they were
            host = rng.choice(list(hosts)) if hosts else ""
            region = rng.choice(list(regions)) if regions else ""
            server = rng.choice(list(servers)) if servers else "nats"
            operator = rng.choice(list(operators)) if operators else "operator"
            offset = rng.choice(SKEWS)
            holds |= {
                "cut": rng.uniform(3.0, 8.0),
                "oneway": rng.uniform(3.0, 8.0),
                "flap": rng.uniform(3.0, 6.0),
                "latency": rng.uniform(3.0, 6.0),
                "skew": rng.uniform(4.0, 8.0),
                "region": rng.uniform(5.0, 9.0),
            }
            target = {
                "nats": server,
                "operator": operator,
                "cut": host,
                "oneway": host,
                "flap": host,
                "latency": host,
                "skew": worker,
                "region": region,
            }.get(kind, target)
            skew = offset if kind == "skew" else ""
        hold = holds[kind]
        steps.append(
            FaultStep(
                at=round(at, 3),
                kind=kind,
                target=target,
                hold=round(hold, 3),
                on_reserve=on_reserve and kind in ("kill", "freeze"),
                skew=skew,
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
