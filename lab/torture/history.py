"""The history of a torture run: what was attempted, what broke, what the host ran; written as JSONL.

Why it exists: the checker (`lab.torture.check`) must judge a run from the record alone, after the fact,
the way Jepsen's checkers read a history: it never asks the fleet anything. So every fact it needs is one
record here: each client operation with its invoke and completion times and its outcome (`ok` with what
the fleet answered, `refused` with the error's code, `unknown` when no answer came), each fault, the
periodic samples of the host's machine processes and the workers' listings, the final snapshot, the
operator probe, the operator app's machine events, and on hosts what a cut-off region did on its own. Times
are wall-clock epoch seconds (`time.time()`), the clock a worker stamps a lease's `expires_at` and an event's
`timestamp` with, so they compare (a worker under a skewed clock stamps its own: `Fault.skew` says by how much).

The file is one record per line, tagged by `type`, appended and flushed as the run goes: a run killed
halfway still leaves what it saw.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Literal

import msgspec

Outcome = Literal["ok", "refused", "unknown", "skipped"]


class Meta(msgspec.Struct, tag="meta", kw_only=True):
    """What the run was: written first."""

    seed: int
    duration_s: float
    faults: list[str]
    started_at: float
    run_dir: str
    marker: str  # the value of FAUXMAD_TORTURE in every machine's environment: this run's processes
    workers: dict[str, str]  # worker id -> region
    capacity: dict[str, list[int]]  # worker id -> [cpus, memory_mb] it was started with
    operator_app: str
    operator_counts: dict[str, int]  # region -> primaries the operator must keep
    client_apps: list[str]
    topology: str = "local"  # local (one host) | cluster (3 hosts, 3 servers) | supercluster (3 regions of hosts)
    hosts: dict[str, list[str]] = {}  # host name -> the worker ids it runs (a run on hosts)


class Op(msgspec.Struct, tag="op", kw_only=True):
    """One request a client sent (or a planned step it skipped), from invoke to completion."""

    client: str
    step: int  # the client's plan step this request belongs to
    kind: str  # create | start | stop | destroy | lease | release
    app: str
    invoke: float
    complete: float | None = None
    outcome: Outcome = "unknown"
    code: int | None = None  # the error's code when refused (or a 5xx whose outcome is unknown)
    error: str = ""
    machine_id: str | None = None  # the machine acted on (for create: the one acknowledged)
    key: str | None = None  # create: the idempotency key
    region: str | None = None  # create: the region asked for
    replay: bool = False  # create: a re-send of a key already acknowledged (not an action of its own)
    attempt: int = 1  # create: the attempt of this key (a key is retried after a timeout or a 5xx)
    holder: str | None = None  # lease
    nonce: str | None = None  # lease, release
    expires_at: float | None = None  # lease: as the worker granted it
    state: str | None = None  # the machine's state in the answer


class Fault(msgspec.Struct, tag="fault", kw_only=True):
    """One fault, from the strike to the recovery (the restart, the SIGCONT)."""

    kind: str  # kill | freeze | nats | broker | operator
    target: str
    start: float
    end: float | None = None
    trigger: str = "schedule"  # schedule | reserve (struck as a reserve went out) | timeout (no reserve came)
    detail: str = ""
    skew: float = 0.0  # skew: seconds the target worker's wall clock ran ahead (negative: behind)


class Proc(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One machine's workload process on this host, as /proc showed it."""

    machine_id: str
    instance_id: str
    worker_id: str
    app: str
    pid: int
    state: str  # /proc/<pid>/stat's state letter: R, S, T (stopped: frozen), ...


class Listed(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One machine as its worker listed it."""

    id: str
    app: str
    state: str
    cpus: int
    memory_mb: int
    instance_id: str
    key: str  # metadata torture_key ("" if none)
    role: str  # metadata fauxmad_role ("" if none)


class WorkerView(msgspec.Struct, kw_only=True):
    """One worker at a sample: its heartbeat (capacity, used) and its own listing (None: it did not answer)."""

    worker_id: str
    region: str
    capacity: list[int] | None = None  # [cpus, memory_mb] from its heartbeat
    used: list[int] | None = None
    listed: list[Listed] | None = None


class Sample(msgspec.Struct, tag="sample", kw_only=True):
    at: float
    phase: str  # run | settle | final
    procs: list[Proc]
    workers: list[WorkerView]


class Probe(msgspec.Struct, tag="probe", kw_only=True):
    """The operator probe after the faults: one of its app's primaries destroyed directly; was it replaced?"""

    app: str
    region: str
    machine_id: str
    destroyed_at: float
    restored_at: float | None = None
    timeout_s: float = 30.0
    error: str = ""


class Event(msgspec.Struct, tag="event", kw_only=True):
    """One transition of an operator-app machine, from stream FAUXMAD_EVENTS (read after the run): what the
    operator did to its app, in the workers' own words and times."""

    at: float  # the worker's commit time, epoch seconds (the event's `timestamp` is in ms)
    machine_id: str
    region: str
    worker_id: str
    status: str
    source: str  # user (someone asked: the operator, the probe) | worker (an exit, a restart)
    reason: str = ""


class RegionProbe(msgspec.Struct, tag="region_probe", kw_only=True):
    """While a region was cut from the others: did it place a machine of its own and answer for it?"""

    region: str
    at: float
    placed: bool = False  # a create in the region, sent to its own servers, was acknowledged
    served: bool = False  # the region's API then listed that machine, started
    machine_id: str = ""
    error: str = ""


class End(msgspec.Struct, tag="end", kw_only=True):
    at: float
    note: str = ""


Record = Meta | Op | Fault | Sample | Probe | Event | RegionProbe | End

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


class HistoryWriter:
    """Appends records to `path` as JSONL, one flush per record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] = path.open("ab")
        self.counts: dict[str, int] = {}

    def write(self, record: Record) -> None:
        self._file.write(_encoder.encode(record) + b"\n")
        self._file.flush()
        kind = type(record).__name__
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def close(self) -> None:
        self._file.close()


def load(path: Path) -> list[Record]:
    """Every record of a history file, in order (a truncated last line is dropped)."""
    return list(parse(path.read_bytes().splitlines()))


def parse(lines: Iterable[bytes]) -> Iterator[Record]:
    for line in lines:
        if not line.strip():
            continue
        try:
            yield _decoder.decode(line)
        except msgspec.DecodeError:
            continue
