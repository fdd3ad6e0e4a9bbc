"""The checker: a pure function from a torture run's history to its violations, each with its evidence.

Why it exists: "it survived the faults" has to mean something precise and the same every time, and be
judged from the record alone (no fleet needed: the unit tests feed it hand-made histories). Ten
properties, each a function here:

1. `lost`: every machine a create acknowledged, and its client did not destroy, exists at the end.
2. `key`: a key's acknowledgements all name one machine id, and at the end at most one machine carries it.
3. `twice`: at no sampled moment does a machine id (or an instance id) run in two processes, on one host or two.
4. `overcommit`: at no sample do a worker's listed machines (or its heartbeat's `used`) exceed its capacity.
5. `registry`: at the end every machine a worker lists as started has exactly one process there, every
   machine process belongs to a machine its worker lists as running, and no machine is listed twice.
6. `last-action`: a machine whose last acknowledged action was stop is stopped, start (or its create) is
   started, destroy is gone; a machine with an unknown outcome after that action is not judged.
7. `lease`: two acknowledged leases of different holders on one machine never overlap, each counted from
   its acknowledgement to its expiry or the release of its nonce (the times it surely held).
8. `operator-count`: the operator's app is at its count of started primaries in every region at the end,
   and once at its count while the fleet settles, never below it again.
9. `operator-replace`: a primary destroyed directly after the faults is replaced within the probe's time.
10. `operator-last-copy`: no stop or destroy someone asked for (during the run: the operator) takes down the
   last started machine of the operator's app in a region, by the machines' own events (a fail-back that
   stops both copies; until the probe, which does this on purpose).

Three more for the network's faults (a run on hosts: `cut`, `oneway`, `flap`, `region` split the fleet):

11. `minority`: an acknowledged create on the minority side (its machine seen on a worker of the cut-off host
    or region before the heal, or a create asked of the cut-off region while it was cut) is never lost: its
    machine is in the fleet at the end unless its client destroyed it.
12. `one-copy`: after every heal, one running copy of each machine: in the last sample before the next fault
    (at least `HEAL_SETTLE_S` after the heal, every worker answering; else the final snapshot), no machine runs
    in two processes or is listed started by two workers, no key has two started machines, and no region of
    the operator's app has more started primaries than its count (a replaced copy left running beside its
    replacement).
13. `region-cut`: a cut-off region keeps placing and serving its own traffic: while it was cut, a create asked
    through its own servers was acknowledged and its list then showed the machine started (`RegionProbe`).

A worker restarted under a skewed clock stamps leases and events with its own clock: the checker takes the
fault's skew back out of what that worker stamped meanwhile (`Fault.skew`), as it judges real time.

Only acknowledged facts count against the fleet: a refused request did nothing, an unknown one may have
done anything, so it excuses what follows it rather than accusing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from lab.torture.history import End, Event, Fault, Listed, Meta, Op, Probe, Record, RegionProbe, Sample
from lab.torture.plan import PARTITIONS

ACTIONS = ("create", "start", "stop", "destroy")
RUNNING = frozenset({"started"})
IN_MOTION = frozenset({"starting", "stopping", "replacing", "restarting", "suspending", "resuming"})
EXPECTED = {"create": "started", "start": "started", "stop": "stopped"}
CHECKS = (
    "lost",
    "key",
    "twice",
    "overcommit",
    "registry",
    "last-action",
    "lease",
    "operator-count",
    "operator-replace",
    "operator-last-copy",
    "minority",
    "one-copy",
    "region-cut",
)
HEAL_SETTLE_S = 15.0  # one-copy: a heal's effects (stale copies retired) are judged this long after it at the least


class Violation(msgspec.Struct, kw_only=True):
    check: str
    message: str
    evidence: dict[str, Any] = {}


class Verdict(msgspec.Struct, kw_only=True):
    operations: dict[str, dict[str, int]]  # kind -> outcome -> count
    refusals: dict[str, int]  # code -> count
    faults: dict[str, int]  # kind -> count
    faults_on_reserve: int
    samples: int
    violations: list[Violation]


class _History:
    """The records of a run, sorted by type."""

    def __init__(self, records: Iterable[Record]) -> None:
        self.meta: Meta | None = None
        self.ops: list[Op] = []
        self.faults: list[Fault] = []
        self.samples: list[Sample] = []
        self.probes: list[Probe] = []
        self.events: list[Event] = []
        self.region_probes: list[RegionProbe] = []
        for record in records:
            if isinstance(record, Meta):
                self.meta = record
            elif isinstance(record, Op):
                self.ops.append(record)
            elif isinstance(record, Fault):
                self.faults.append(record)
            elif isinstance(record, Sample):
                self.samples.append(record)
            elif isinstance(record, Probe):
                self.probes.append(record)
            elif isinstance(record, Event):
                self.events.append(record)
            elif isinstance(record, RegionProbe):
                self.region_probes.append(record)
            elif isinstance(record, End):
                pass
        self.t0 = self.meta.started_at if self.meta else min((o.invoke for o in self.ops), default=0.0)
        finals = [s for s in self.samples if s.phase == "final"]
        self.final: Sample | None = finals[-1] if finals else None
        self.skews = [f for f in self.faults if f.kind == "skew" and f.skew]
        self._unskew_events()

    def _unskew_events(self) -> None:
        """Each event a worker stamped under a skewed clock, back in real time. The skewed process runs strictly
        inside its fault (started after `start`, stopped before `end` is stamped), so an event whose corrected
        time falls outside it was stamped by the worker's own clock before or after, and is taken as written: a
        stop stamped just after the fault by the restarted worker is not moved back into it (seed 107).
        Left ambiguous: a skew behind (-30 s) over a fault shorter than it, where an event stamped in the 30 s
        before the fault could be either (the history has no stored time to tell them apart)."""
        for event in self.events:
            for fault in self.skews:
                real = event.at - fault.skew
                if event.worker_id == fault.target and fault.start <= real <= (fault.end or real):
                    event.at = real
                    break

    def real_expiry(self, op: Op, seen_on: dict[str, list[tuple[str, float]]]) -> float:
        """A lease's expiry in real time: a worker under a skewed clock granted it with its own."""
        assert op.expires_at is not None and op.complete is not None
        workers = {w for w, _ in seen_on.get(op.machine_id or "", [])}
        for fault in self.skews:
            if fault.target in workers and fault.start <= op.complete <= (fault.end or op.complete):
                return op.expires_at - fault.skew
        return op.expires_at

    def t(self, at: float | None) -> str:
        return "?" if at is None else f"t+{at - self.t0:.2f}s"

    def final_listing(self) -> dict[str, list[tuple[str, Listed]]]:
        """machine id -> [(worker id, as listed)] in the final snapshot."""
        found: dict[str, list[tuple[str, Listed]]] = defaultdict(list)
        if self.final is not None:
            for view in self.final.workers:
                for machine in view.listed or []:
                    found[machine.id].append((view.worker_id, machine))
        return found

    def seen_on(self) -> dict[str, list[tuple[str, float]]]:
        """machine id -> [(worker id, sample time)] of every sample that listed it."""
        found: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for sample in self.samples:
            for view in sample.workers:
                for machine in view.listed or []:
                    found[machine.id].append((view.worker_id, sample.at))
        return found

    def side_of(self, fault: Fault) -> set[str]:
        """The workers a partition cut off: the target host's, or the target region's."""
        if self.meta is None:
            return set()
        if fault.kind == "region":
            return {w for w, region in self.meta.workers.items() if region == fault.target}
        return set(self.meta.hosts.get(fault.target, []))


# -- 1 -----------------------------------------------------------------------------------------------
def check_lost(h: _History) -> list[Violation]:
    if h.final is None:
        return [Violation(check="lost", message="no final snapshot: nothing can be said of what survived")]
    present = h.final_listing()
    maybe_destroyed = {o.machine_id for o in h.ops if o.kind == "destroy" and o.outcome in ("ok", "unknown")}
    acked: dict[str, Op] = {}
    for op in h.ops:
        if op.kind == "create" and op.outcome == "ok" and op.machine_id and op.machine_id not in acked:
            acked[op.machine_id] = op
    out = []
    for machine_id, op in acked.items():
        if machine_id in maybe_destroyed or machine_id in present:
            continue
        out.append(
            Violation(
                check="lost",
                message=f"machine {machine_id} (key {op.key}, client {op.client}) acknowledged at {h.t(op.complete)}"
                " and never destroyed is not in the fleet at the end",
                evidence={"machine_id": machine_id, "key": op.key, "client": op.client, "acked_at": op.complete},
            )
        )
    return out


# -- 2 -----------------------------------------------------------------------------------------------
def check_keys(h: _History) -> list[Violation]:
    named: dict[str, dict[str, float]] = defaultdict(dict)  # key -> machine id -> first ack
    for op in h.ops:
        if op.kind == "create" and op.outcome == "ok" and op.key and op.machine_id:
            named[op.key].setdefault(op.machine_id, op.complete or op.invoke)
    out = []
    for key, ids in sorted(named.items()):
        if len(ids) > 1:
            acks = ", ".join(f"{m} at {h.t(at)}" for m, at in sorted(ids.items(), key=lambda kv: kv[1]))
            out.append(
                Violation(
                    check="key",
                    message=f"key {key} was acknowledged with {len(ids)} machines: {acks}",
                    evidence={"key": key, "machines": sorted(ids)},
                )
            )
    carriers: dict[str, set[str]] = defaultdict(set)
    for machine_id, places in h.final_listing().items():
        for _, machine in places:
            if machine.key:
                carriers[machine.key].add(machine_id)
    for key, carried in sorted(carriers.items()):
        if len(carried) > 1:
            out.append(
                Violation(
                    check="key",
                    message=f"key {key} is carried by {len(carried)} machines at the end: {', '.join(sorted(carried))}",
                    evidence={"key": key, "machines": sorted(carried)},
                )
            )
    return out


# -- 3 -----------------------------------------------------------------------------------------------
def check_twice(h: _History) -> list[Violation]:
    Procs = list[tuple[int, str, str]]  # (pid, worker id, machine id)
    first: dict[tuple[str, str], tuple[Sample, Procs]] = {}
    seen: Counter[tuple[str, str]] = Counter()
    for sample in h.samples:
        by_machine: dict[str, set[tuple[int, str, str]]] = defaultdict(set)
        by_instance: dict[str, set[tuple[int, str, str]]] = defaultdict(set)
        for p in sample.procs:
            by_machine[p.machine_id].add((p.pid, p.worker_id, p.machine_id))
            if p.instance_id:
                by_instance[p.instance_id].add((p.pid, p.worker_id, p.machine_id))
        doubled = [("machine", m, found) for m, found in by_machine.items() if len(found) > 1]
        doubled += [
            ("instance", i, found)
            for i, found in by_instance.items()
            if len({machine for _, _, machine in found}) > 1  # one machine's doubles are reported above
        ]
        for what, name, found in doubled:
            seen[(what, name)] += 1
            first.setdefault((what, name), (sample, sorted(found)))
    out = []
    for (what, name), (sample, procs) in first.items():
        where = ", ".join(
            f"pid {pid} on {worker}" + (f" (machine {m})" if what == "instance" else "") for pid, worker, m in procs
        )
        out.append(
            Violation(
                check="twice",
                message=f"{what} {name} ran in {len(procs)} processes at once at {h.t(sample.at)}: {where}"
                f" (in {seen[(what, name)]} sample(s))",
                evidence={
                    what: name,
                    "at": sample.at,
                    "processes": [list(p) for p in procs],
                    "samples": seen[(what, name)],
                },
            )
        )
    return out


# -- 4 -----------------------------------------------------------------------------------------------
def check_overcommit(h: _History) -> list[Violation]:
    capacity = h.meta.capacity if h.meta else {}
    first: dict[tuple[str, str], Violation] = {}
    count: Counter[tuple[str, str]] = Counter()
    for sample in h.samples:
        for view in sample.workers:
            cap = capacity.get(view.worker_id) or view.capacity
            if view.listed is not None and cap is not None:
                cpus = sum(m.cpus for m in view.listed)
                memory = sum(m.memory_mb for m in view.listed)
                if cpus > cap[0] or memory > cap[1]:
                    key = (view.worker_id, "listed")
                    count[key] += 1
                    first.setdefault(
                        key,
                        Violation(
                            check="overcommit",
                            message=f"worker {view.worker_id} listed {cpus} cpus / {memory} MB of machines at"
                            f" {h.t(sample.at)}, over its capacity {cap[0]} cpus / {cap[1]} MB",
                            evidence={
                                "worker_id": view.worker_id,
                                "at": sample.at,
                                "reserved": [cpus, memory],
                                "capacity": cap,
                                "machines": [m.id for m in view.listed],
                            },
                        ),
                    )
            used, beat = view.used, view.capacity
            if used is not None and beat is not None and (used[0] > beat[0] or used[1] > beat[1]):
                key = (view.worker_id, "heartbeat")
                count[key] += 1
                first.setdefault(
                    key,
                    Violation(
                        check="overcommit",
                        message=f"worker {view.worker_id}'s heartbeat said used {used} over capacity {beat}"
                        f" at {h.t(sample.at)}",
                        evidence={"worker_id": view.worker_id, "at": sample.at, "used": used, "capacity": beat},
                    ),
                )
    for key, violation in first.items():
        violation.message += f" (in {count[key]} sample(s))"
    return list(first.values())


# -- 5 -----------------------------------------------------------------------------------------------
def check_registry(h: _History) -> list[Violation]:
    if h.final is None:
        return []
    out = []
    procs: dict[tuple[str, str], list[int]] = defaultdict(list)  # (worker, machine) -> pids
    for p in h.final.procs:
        procs[(p.worker_id, p.machine_id)].append(p.pid)
    states: dict[tuple[str, str], str] = {}
    for view in h.final.workers:
        if view.listed is None:
            out.append(
                Violation(
                    check="registry",
                    message=f"worker {view.worker_id} did not answer its listing in the final snapshot",
                    evidence={"worker_id": view.worker_id},
                )
            )
            continue
        for m in view.listed:
            states[(view.worker_id, m.id)] = m.state
            pids = procs.get((view.worker_id, m.id), [])
            if (m.state in RUNNING and len(pids) != 1) or (m.state not in RUNNING | IN_MOTION and pids):
                out.append(
                    Violation(
                        check="registry",
                        message=f"machine {m.id} ({m.app}) is listed {m.state} by {view.worker_id} but has"
                        f" {len(pids)} process(es) there" + (f": pids {sorted(pids)}" if pids else ""),
                        evidence={
                            "machine_id": m.id,
                            "worker_id": view.worker_id,
                            "state": m.state,
                            "pids": sorted(pids),
                        },
                    )
                )
    answered = {v.worker_id for v in h.final.workers if v.listed is not None}
    for (worker_id, machine_id), pids in sorted(procs.items()):
        if (worker_id, machine_id) not in states and worker_id in answered:
            out.append(
                Violation(
                    check="registry",
                    message=f"process(es) {sorted(pids)} of machine {machine_id} run for {worker_id}, which does not"
                    " list that machine",
                    evidence={"machine_id": machine_id, "worker_id": worker_id, "pids": sorted(pids)},
                )
            )
    for machine_id, places in sorted(h.final_listing().items()):
        if len(places) > 1:
            where = ", ".join(f"{w} ({m.state})" for w, m in places)
            out.append(
                Violation(
                    check="registry",
                    message=f"machine {machine_id} is listed by {len(places)} workers at the end: {where}",
                    evidence={"machine_id": machine_id, "workers": [w for w, _ in places]},
                )
            )
    return out


# -- 6 -----------------------------------------------------------------------------------------------
def check_last_action(h: _History) -> list[Violation]:
    if h.final is None:
        return []
    present = h.final_listing()
    by_machine: dict[str, list[Op]] = defaultdict(list)
    for op in h.ops:
        if op.kind in ACTIONS and op.machine_id and not op.replay and op.outcome != "skipped":
            by_machine[op.machine_id].append(op)
    out = []
    for machine_id, ops in sorted(by_machine.items()):
        ops.sort(key=lambda o: o.invoke)
        acked = [i for i, o in enumerate(ops) if o.outcome == "ok"]
        if not acked:
            continue
        last = ops[acked[-1]]
        if any(o.outcome == "unknown" for o in ops[acked[-1] + 1 :]):
            continue
        places = present.get(machine_id, [])
        actual = places[0][1].state if places else "gone"
        if last.kind == "destroy":
            expected = "gone"
        elif last.kind == "create" and last.state not in ("started", "starting"):
            continue  # acknowledged as something else (it failed to start): nothing was promised
        else:
            expected = EXPECTED[last.kind]
        if actual != expected:
            out.append(
                Violation(
                    check="last-action",
                    message=f"machine {machine_id} ({last.app}): the last acknowledged action was {last.kind} at"
                    f" {h.t(last.complete)}, but at the end it is {actual}, not {expected}",
                    evidence={
                        "machine_id": machine_id,
                        "action": last.kind,
                        "acked_at": last.complete,
                        "state": actual,
                    },
                )
            )
    return out


# -- 7 -----------------------------------------------------------------------------------------------
def check_leases(h: _History) -> list[Violation]:
    released: dict[str, float] = {}
    for op in h.ops:
        if op.kind == "release" and op.nonce and op.outcome != "skipped":
            released[op.nonce] = min(released.get(op.nonce, op.invoke), op.invoke)
    held: dict[str, list[tuple[float, float, Op]]] = defaultdict(list)
    seen_on = h.seen_on() if h.skews else {}
    for op in h.ops:
        if op.kind == "lease" and op.outcome == "ok" and op.machine_id and op.complete and op.expires_at:
            expires = h.real_expiry(op, seen_on)
            end = min(expires, released.get(op.nonce or "", expires))
            if end > op.complete:
                held[op.machine_id].append((op.complete, end, op))
    out = []
    for machine_id, spans in sorted(held.items()):
        spans.sort(key=lambda s: s[0])
        for i, (start_a, end_a, a) in enumerate(spans):
            for start_b, end_b, b in spans[i + 1 :]:
                if start_b >= end_a:
                    break
                if a.holder != b.holder and start_a < end_b:
                    out.append(
                        Violation(
                            check="lease",
                            message=f"machine {machine_id} was leased to {a.holder} ({h.t(start_a)}..{h.t(end_a)}) and"
                            f" to {b.holder} ({h.t(start_b)}..{h.t(end_b)}) at once",
                            evidence={
                                "machine_id": machine_id,
                                "leases": [[a.holder, a.nonce, start_a, end_a], [b.holder, b.nonce, start_b, end_b]],
                            },
                        )
                    )
    return out


# -- 8 -----------------------------------------------------------------------------------------------
def _primaries(sample: Sample, app: str) -> dict[str, int] | None:
    """Started primaries of `app` per region, or None if a worker did not answer."""
    counts: Counter[str] = Counter()
    for view in sample.workers:
        if view.listed is None:
            return None
        for m in view.listed:
            if m.app == app and m.role == "primary" and m.state in RUNNING:
                counts[view.region] += 1
    return dict(counts)


def check_operator_count(h: _History) -> list[Violation]:
    if h.meta is None or not h.meta.operator_counts:
        return []
    app, want = h.meta.operator_app, h.meta.operator_counts
    out = []
    reached = False
    for sample in [s for s in h.samples if s.phase == "settle"]:
        have = _primaries(sample, app)
        if have is None:
            continue
        below = {r: have.get(r, 0) for r, n in want.items() if have.get(r, 0) < n}
        if not below:
            reached = True
        elif reached:
            out.append(
                Violation(
                    check="operator-count",
                    message=f"{app} fell below its count while settling at {h.t(sample.at)}: started primaries"
                    f" {below}, wanted {want}",
                    evidence={"app": app, "at": sample.at, "have": have, "want": want},
                )
            )
            break
    if h.final is not None:
        have = _primaries(h.final, app) or {}
        below = {r: have.get(r, 0) for r, n in want.items() if have.get(r, 0) < n}
        if below:
            out.append(
                Violation(
                    check="operator-count",
                    message=f"{app} is below its count at the end: started primaries {below}, wanted {want}",
                    evidence={"app": app, "at": h.final.at, "have": have, "want": want},
                )
            )
    return out


# -- 9 -----------------------------------------------------------------------------------------------
def check_operator_replace(h: _History) -> list[Violation]:
    out = []
    for probe in h.probes:
        if probe.error:
            out.append(
                Violation(
                    check="operator-replace",
                    message=f"the probe of {probe.app} failed: {probe.error}",
                    evidence={"app": probe.app, "error": probe.error},
                )
            )
        elif probe.restored_at is None:
            out.append(
                Violation(
                    check="operator-replace",
                    message=f"primary {probe.machine_id} of {probe.app} in {probe.region}, destroyed at"
                    f" {h.t(probe.destroyed_at)}, was not replaced within {probe.timeout_s:g}s",
                    evidence={"app": probe.app, "machine_id": probe.machine_id, "destroyed_at": probe.destroyed_at},
                )
            )
    return out


# -- 10 ----------------------------------------------------------------------------------------------
def check_operator_last_copy(h: _History) -> list[Violation]:
    cutoff = min((p.destroyed_at for p in h.probes), default=float("inf"))
    app = h.meta.operator_app if h.meta else "the operator's app"
    started: dict[str, set[str]] = defaultdict(set)
    last_down: dict[str, Event] = {}
    out = []
    for event in sorted(h.events, key=lambda e: e.at):
        if event.at >= cutoff:
            break
        running = started[event.region]
        if event.status == "started":
            running.add(event.machine_id)
            continue
        if event.machine_id not in running:
            continue
        running.discard(event.machine_id)
        before = last_down.get(event.region)
        if event.source == "user":
            last_down[event.region] = event
        if event.source == "user" and not running:
            also = (
                f"; just before, {before.machine_id} went {before.status} at {h.t(before.at)} ({before.reason})"
                if before is not None and event.at - before.at < 10
                else ""
            )
            out.append(
                Violation(
                    check="operator-last-copy",
                    message=f"{event.machine_id} of {app} went {event.status} at {h.t(event.at)} on request"
                    f" ({event.reason}), leaving no started machine of it in {event.region}{also}",
                    evidence={
                        "machine_id": event.machine_id,
                        "region": event.region,
                        "at": event.at,
                        "reason": event.reason,
                        "before": [before.machine_id, before.status, before.at, before.reason] if before else None,
                    },
                )
            )
    return out


# -- 11 ----------------------------------------------------------------------------------------------
def check_minority(h: _History) -> list[Violation]:
    partitions = [f for f in h.faults if f.kind in PARTITIONS and f.end is not None]
    if h.final is None or not partitions:
        return []
    present = h.final_listing()
    maybe_destroyed = {o.machine_id for o in h.ops if o.kind == "destroy" and o.outcome in ("ok", "unknown")}
    seen_on = h.seen_on()
    acked: dict[str, Op] = {}
    for op in h.ops:
        if op.kind == "create" and op.outcome == "ok" and op.machine_id and op.complete:
            acked.setdefault(op.machine_id, op)
    out = []
    for machine_id, op in acked.items():
        if machine_id in present or machine_id in maybe_destroyed:
            continue
        for fault in partitions:
            assert fault.end is not None and op.complete is not None
            if op.complete > fault.end:
                continue  # acknowledged after this heal: not this partition's minority
            side = h.side_of(fault)
            asked_there = fault.kind == "region" and op.region == fault.target and op.complete >= fault.start
            lived_there = any(w in side and at <= fault.end for w, at in seen_on.get(machine_id, []))
            if asked_there or lived_there:
                where = "asked of" if asked_there else "on"
                out.append(
                    Violation(
                        check="minority",
                        message=f"machine {machine_id} (key {op.key}, client {op.client}), acknowledged at"
                        f" {h.t(op.complete)} {where} the minority side of {fault.kind} {fault.target}"
                        f" ({h.t(fault.start)}..{h.t(fault.end)}), is gone after the heal and nobody destroyed it",
                        evidence={
                            "machine_id": machine_id,
                            "key": op.key,
                            "acked_at": op.complete,
                            "fault": [fault.kind, fault.target, fault.start, fault.end],
                        },
                    )
                )
                break
    return out


# -- 12 ----------------------------------------------------------------------------------------------
def _copies(h: _History, sample: Sample) -> list[str]:
    """What runs more than once in `sample`: machines, keys, and the operator app's primaries over its count."""
    listed: Counter[str] = Counter()
    keys: dict[str, set[str]] = defaultdict(set)
    primaries: Counter[str] = Counter()
    app = h.meta.operator_app if h.meta else ""
    for view in sample.workers:
        for m in view.listed or []:
            if m.state not in RUNNING:
                continue
            listed[m.id] += 1
            if m.key:
                keys[m.key].add(m.id)
            if m.app == app and m.role == "primary":
                primaries[view.region] += 1
    processes = Counter(p.machine_id for p in sample.procs)
    found = [f"machine {m} listed started by {n} workers" for m, n in sorted(listed.items()) if n > 1]
    found += [f"machine {m} in {n} processes" for m, n in sorted(processes.items()) if n > 1]
    found += [
        f"key {k} on {len(ids)} started machines ({', '.join(sorted(ids))})" for k, ids in keys.items() if len(ids) > 1
    ]
    want = h.meta.operator_counts if h.meta else {}
    found += [
        f"{app} has {n} started primaries in {region}, its count is {want[region]}"
        for region, n in sorted(primaries.items())
        if region in want and n > want[region]
    ]
    return found


def check_one_copy(h: _History) -> list[Violation]:
    heals = sorted((f for f in h.faults if f.kind in PARTITIONS and f.end is not None), key=lambda f: f.start)
    out = []
    said: set[str] = set()
    for fault in heals:
        assert fault.end is not None
        later = [f.start for f in h.faults if f.start > fault.end]
        until = min(later, default=float("inf"))
        quiet = [
            s
            for s in h.samples
            if s.phase != "final"
            and fault.end + HEAL_SETTLE_S <= s.at < until
            and all(v.listed is not None for v in s.workers)
        ]
        judged = quiet[-1] if quiet else h.final
        if judged is None:
            continue
        for problem in _copies(h, judged):
            if problem in said:
                continue
            said.add(problem)
            out.append(
                Violation(
                    check="one-copy",
                    message=f"after the heal of {fault.kind} {fault.target} at {h.t(fault.end)}, at {h.t(judged.at)}"
                    f" ({judged.phase}): {problem}",
                    evidence={"fault": [fault.kind, fault.target, fault.start, fault.end], "at": judged.at},
                )
            )
    return out


# -- 13 ----------------------------------------------------------------------------------------------
def check_region_cut(h: _History) -> list[Violation]:
    out = []
    for fault in (f for f in h.faults if f.kind == "region"):
        end = fault.end if fault.end is not None else float("inf")
        probes = [p for p in h.region_probes if p.region == fault.target and fault.start <= p.at <= end]
        if probes and probes[-1].placed and probes[-1].served:
            continue
        probe = probes[-1] if probes else None
        why = (
            "nobody asked it"
            if probe is None
            else ("it placed nothing" if not probe.placed else f"it did not list its machine {probe.machine_id}")
            + (f": {probe.error}" if probe.error else "")
        )
        out.append(
            Violation(
                check="region-cut",
                message=f"region {fault.target}, cut off {h.t(fault.start)}..{h.t(fault.end)}, did not place and"
                f" serve its own traffic: {why}",
                evidence={"region": fault.target, "start": fault.start, "end": fault.end},
            )
        )
    return out


CHECKERS = (
    check_lost,
    check_keys,
    check_twice,
    check_overcommit,
    check_registry,
    check_last_action,
    check_leases,
    check_operator_count,
    check_operator_replace,
    check_operator_last_copy,
    check_minority,
    check_one_copy,
    check_region_cut,
)


def check(records: Sequence[Record]) -> Verdict:
    """Judge a history: counts of what happened and every violation found."""
    h = _History(records)
    operations: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    refusals: Counter[str] = Counter()
    for op in h.ops:
        kind = "replay" if op.replay else op.kind
        operations[kind][op.outcome] += 1
        if op.outcome == "refused" and op.code is not None:
            refusals[str(op.code)] += 1
    violations = [v for checker in CHECKERS for v in checker(h)]
    return Verdict(
        operations={k: dict(v) for k, v in sorted(operations.items())},
        refusals=dict(sorted(refusals.items())),
        faults=dict(sorted(Counter(f.kind for f in h.faults).items())),
        faults_on_reserve=sum(1 for f in h.faults if f.trigger == "reserve"),
        samples=sum(1 for s in h.samples if s.phase != "final"),
        violations=violations,
    )
