"""`fauxmad bench proxy --against REV`: this tree's edge proxy beside another revision's, in one run.

A change to the proxy's hot path (its parser, say) is judged against the proxy it replaces, on the same
fleet, machine and noise. REV's tree is exported with `git archive` into a temporary directory and its
`fauxmad proxy` is run from there (PYTHONPATH and working directory: its own `orchestrator` package, this
virtualenv's dependencies), beside this tree's. Both front the same machines. Then rounds: in each, GETs
one at a time go direct, through this proxy and through REV's, in turn (so all three see the same
moment); then wrk (or the asyncio client) drives each proxy in turn, the order swapped every round.
The overhead is each side's p50 less the direct p50 over all rounds' samples; the throughput is the
median of each side's rounds; the ratios are this tree's over REV's. Each round's overhead (p50 and p99 less
the direct ones of the same round) and its ratio are kept and shown too: a pooled ratio of 1.1 means little
until it is set beside how far the rounds' ratios spread.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from lab.bench import BenchError
from lab.bench import proxy as bench
from lab.bench.against import BadRevision
from lab.bench.http_client import Client
from lab.bench.report import Report, Table
from lab.bench.stats import summarize
from orchestrator.devfleet import DevFleet, FleetSpec

ROOT = Path(__file__).resolve().parents[2]


class Side(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # "this tree" or the revision
    p50_ms: float
    p99_ms: float
    overhead_p50_ms: float  # p50 less the direct p50
    overhead_p99_ms: float
    requests_per_second: float  # the median of the rounds
    rounds_per_second: list[float]
    rounds_overhead_p50_ms: list[float]  # each round's p50 less that round's direct p50
    rounds_overhead_p99_ms: list[float]
    proxy_cpu_us_per_request: float  # the median of the rounds
    errors: int


class AgainstResult(msgspec.Struct, kw_only=True):
    options: bench.ProxyOptions
    rev: str
    commit: str
    rounds: int
    upstream: str
    load_generator: str
    direct_p50_ms: float
    direct_p99_ms: float
    rounds_direct_p50_ms: list[float]
    this: Side
    other: Side
    overhead_p50_ratio: float  # this tree's over REV's (below 1: less overhead)
    rounds_overhead_p50_ratio: list[float]  # the same, round by round (0.0 where REV's overhead was not positive)
    throughput_ratio: float  # this tree's over REV's (above 1: faster)


def overhead(direct: list[float], proxied: list[float]) -> tuple[float, float]:
    """(p50, p99) of the proxied GETs less those of the direct ones, in ms; samples in seconds."""
    d, p = summarize(direct), summarize(proxied)
    return round(p.p50_ms - d.p50_ms, 3), round(p.p99_ms - d.p99_ms, 3)


def overhead_ratio(mine: float, theirs: float) -> float:
    """This tree's overhead over REV's, to three decimals; 0.0 where REV's is not positive (no ratio)."""
    return round(mine / theirs, 3) if theirs > 0 else 0.0


def _export(rev: str, into: Path) -> str:
    """REV's tree into `into`; its full commit id."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise BadRevision(f"--against {rev!r}: not a commit of this repository")
    commit = found.stdout.strip()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, capture_output=True)
    if archive.wait() != 0 or untar.returncode != 0:
        raise BenchError(f"could not export {rev}: {untar.stderr.decode(errors='replace')[-300:]}")
    return commit


async def _three_ways(
    machine_port: int, ports: tuple[int, int], n: int
) -> tuple[list[float], list[float], list[float], int, int]:
    """n GETs each: direct, through this proxy, through REV's, in turn."""
    host = f"{bench.APP}.localhost"
    clients = [Client(machine_port), Client(ports[0]), Client(ports[1])]
    times: list[list[float]] = [[], [], []]
    errors = [0, 0, 0]
    try:
        for _ in range(50):  # warm every path
            for client in clients:
                await client.request(host)
        for _ in range(n):
            for i, client in enumerate(clients):
                started = time.perf_counter()
                errors[i] += (await client.request(host)).status != 200
                times[i].append(time.perf_counter() - started)
    finally:
        for client in clients:
            await client.close()
    return times[0], times[1], times[2], errors[1], errors[2]


def run_proxy_against(
    options: bench.ProxyOptions, rev: str, rounds: int = 4, progress: Callable[[str], None] = lambda line: None
) -> AgainstResult:
    with tempfile.TemporaryDirectory(prefix="fauxmad-bench-proxy-") as scratch:
        tree = Path(scratch)
        commit = _export(rev, tree)
        progress(f"{rev} ({commit[:12]}) exported to {tree}")
        spec = FleetSpec(regions=[bench.REGION], workers_per_region=1, cpus=8, memory_mb=4096)
        with DevFleet(spec, progress=progress) as fleet:
            _, machine_port = asyncio.run(bench._machine(fleet.url))
            logs = fleet.root / "logs"
            this_proc, this_port = bench._start_proxy(fleet.url, logs / "proxy-this.log")
            try:
                other_proc, other_port = bench._start_proxy(fleet.url, logs / "proxy-against.log", tree=tree)
                try:
                    return _rounds(options, rev, commit, rounds, fleet, machine_port, progress,
                                   (this_proc, this_port), (other_proc, other_port))  # fmt: skip
                finally:
                    other_proc.terminate()
                    other_proc.wait(10)
            finally:
                this_proc.terminate()
                this_proc.wait(10)


def _rounds(
    options: bench.ProxyOptions,
    rev: str,
    commit: str,
    rounds: int,
    fleet: DevFleet,
    machine_port: int,
    progress: Callable[[str], None],
    this: tuple[subprocess.Popen[bytes], int],
    other: tuple[subprocess.Popen[bytes], int],
) -> AgainstResult:
    binary = bench._compile_tiny(fleet.root)
    native_id = None
    if binary is not None:  # the cheapest upstream, so the throughput is the proxies'
        native_id, _ = asyncio.run(bench._machine(fleet.url, bench.NATIVE_APP, f'["{binary}"]'))
    upstream, app = ("examples/echo/tiny.c", bench.NATIVE_APP) if native_id else ("examples/echo/app.py", bench.APP)
    direct: list[float] = []
    rounds_direct: list[float] = []
    latencies: tuple[list[float], list[float]] = ([], [])
    overheads: tuple[list[tuple[float, float]], list[tuple[float, float]]] = ([], [])
    rates: tuple[list[float], list[float]] = ([], [])
    cpus: tuple[list[float], list[float]] = ([], [])
    errors = [0, 0]
    per_round = max(10, options.requests // rounds)
    throughput = None
    for number in range(rounds):
        progress(f"round {number + 1} of {rounds}: {per_round} GETs direct, through this tree's proxy, through {rev}'s")
        d, a, b, ea, eb = asyncio.run(_three_ways(machine_port, (this[1], other[1]), per_round))
        direct += d
        rounds_direct.append(summarize(d).p50_ms)
        overheads[0].append(overhead(d, a))
        overheads[1].append(overhead(d, b))
        latencies[0].extend(a)
        latencies[1].extend(b)
        errors[0] += ea
        errors[1] += eb
        order = (0, 1) if number % 2 == 0 else (1, 0)
        for which in order:
            proc, port = (this, other)[which]
            progress(f"round {number + 1}: {options.concurrency} keep-alive clients, {options.seconds:g} s, "
                     f"through {'this tree' if which == 0 else rev}'s proxy to {upstream}")  # fmt: skip
            throughput = bench._throughput(proc, port, app, upstream, options)
            rates[which].append(throughput.requests_per_second)
            cpus[which].append(throughput.proxy_cpu_us_per_request)
            errors[which] += throughput.errors
    assert throughput is not None
    direct_lat = summarize(direct)

    def side(i: int, name: str) -> Side:
        lat = summarize(latencies[i])
        return Side(
            name=name,
            p50_ms=lat.p50_ms,
            p99_ms=lat.p99_ms,
            overhead_p50_ms=round(lat.p50_ms - direct_lat.p50_ms, 3),
            overhead_p99_ms=round(lat.p99_ms - direct_lat.p99_ms, 3),
            requests_per_second=round(statistics.median(rates[i]), 1),
            rounds_per_second=rates[i],
            rounds_overhead_p50_ms=[p50 for p50, _ in overheads[i]],
            rounds_overhead_p99_ms=[p99 for _, p99 in overheads[i]],
            proxy_cpu_us_per_request=round(statistics.median(cpus[i]), 1),
            errors=errors[i],
        )

    mine, theirs = side(0, "this tree"), side(1, rev)
    return AgainstResult(
        options=options,
        rev=rev,
        commit=commit,
        rounds=rounds,
        upstream=upstream,
        load_generator=throughput.load_generator,
        direct_p50_ms=direct_lat.p50_ms,
        direct_p99_ms=direct_lat.p99_ms,
        rounds_direct_p50_ms=rounds_direct,
        this=mine,
        other=theirs,
        overhead_p50_ratio=overhead_ratio(mine.overhead_p50_ms, theirs.overhead_p50_ms),
        rounds_overhead_p50_ratio=[
            overhead_ratio(a, b)
            for a, b in zip(mine.rounds_overhead_p50_ms, theirs.rounds_overhead_p50_ms, strict=True)
        ],
        throughput_ratio=round(mine.requests_per_second / theirs.requests_per_second, 3)
        if theirs.requests_per_second
        else 0.0,
    )


def report(result: AgainstResult) -> Report:
    def row(s: Side) -> tuple[str, ...]:
        return (
            s.name,
            f"{s.overhead_p50_ms:.3f}",
            f"{s.overhead_p99_ms:.3f}",
            f"{s.requests_per_second:,.0f}",
            f"{s.proxy_cpu_us_per_request:.0f}",
            str(s.errors),
        )

    table = Table(
        title=f"edge proxy: this tree beside {result.rev} ({result.commit[:12]}), {result.rounds} rounds",
        columns=("proxy", "overhead p50 ms", "overhead p99 ms", "req/s (median)", "CPU us/req", "errors"),
        align="lrrrrr",
        rows=(row(result.this), row(result.other)),
    )
    this, other, rev = result.this, result.other, result.rev

    def each(n: int) -> tuple[str, ...]:
        ms = (result.rounds_direct_p50_ms[n], this.rounds_overhead_p50_ms[n], other.rounds_overhead_p50_ms[n])
        p99 = (this.rounds_overhead_p99_ms[n], other.rounds_overhead_p99_ms[n])
        rates = (this.rounds_per_second[n], other.rounds_per_second[n])
        ratio = _times(result.rounds_overhead_p50_ratio[n])
        return (str(n + 1), *(f"{v:.3f}" for v in ms), ratio, *(f"{v:.3f}" for v in p99), *(f"{v:,.0f}" for v in rates))

    columns = ("round", "direct p50 ms", "overhead p50 ms", f"{rev}'s", "ratio", "overhead p99 ms", f"{rev}'s")
    each_round = Table(
        title=f"each round: overhead over that round's direct GETs, this tree and {rev}",
        columns=(*columns, "req/s", f"{rev}'s"),
        align="rrrrrrrrr",
        rows=tuple(each(n) for n in range(len(result.rounds_direct_p50_ms))),
    )
    spread = [r for r in result.rounds_overhead_p50_ratio if r > 0]
    notes = (
        f"direct to the machine: p50 {result.direct_p50_ms:.3f} ms, p99 {result.direct_p99_ms:.3f} ms",
        f"this tree over {result.rev}: overhead p50 x{result.overhead_p50_ratio:.2f}"
        + (f" (rounds x{min(spread):.2f} to x{max(spread):.2f})" if spread else "")
        + ", "
        f"throughput x{result.throughput_ratio:.2f} ({result.options.concurrency} keep-alive clients from "
        f"{result.load_generator} to {result.upstream})",
    )
    return Report(tables=(table, each_round), notes=notes)


def _times(ratio: float) -> str:
    return f"x{ratio:.2f}" if ratio > 0 else "-"
