"""`fauxmad bench proxy --against REV`: this tree's edge proxy beside another revision's, in one run.

A change to the proxy's hot path (its parser, say) is judged against the proxy it replaces, on the same
fleet, machine and noise. REV's tree is exported with `git archive` into a temporary directory and its
`fauxmad proxy` is run from there (PYTHONPATH and working directory: its own `orchestrator` package, this
virtualenv's dependencies), beside this tree's. Both front the same machines. Then rounds: in each, GETs
one at a time go direct, through this proxy and through REV's, in turn (so all three see the same
moment); then wrk (or the asyncio client) drives each proxy in turn, the order swapped every round.
The overhead is each side's p50 less the direct p50 over all rounds' samples; the throughput is the
median of each side's rounds; the ratios are this tree's over REV's.
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
    this: Side
    other: Side
    overhead_p50_ratio: float  # this tree's over REV's (below 1: less overhead)
    throughput_ratio: float  # this tree's over REV's (above 1: faster)


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
    latencies: tuple[list[float], list[float]] = ([], [])
    rates: tuple[list[float], list[float]] = ([], [])
    cpus: tuple[list[float], list[float]] = ([], [])
    errors = [0, 0]
    per_round = max(10, options.requests // rounds)
    throughput = None
    for number in range(rounds):
        progress(f"round {number + 1} of {rounds}: {per_round} GETs direct, through this tree's proxy, through {rev}'s")
        d, a, b, ea, eb = asyncio.run(_three_ways(machine_port, (this[1], other[1]), per_round))
        direct += d
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
        this=mine,
        other=theirs,
        overhead_p50_ratio=round(mine.overhead_p50_ms / theirs.overhead_p50_ms, 3) if theirs.overhead_p50_ms else 0.0,
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
    notes = (
        f"direct to the machine: p50 {result.direct_p50_ms:.3f} ms, p99 {result.direct_p99_ms:.3f} ms",
        f"this tree over {result.rev}: overhead p50 x{result.overhead_p50_ratio:.2f}, "
        f"throughput x{result.throughput_ratio:.2f} ({result.options.concurrency} keep-alive clients from "
        f"{result.load_generator} to {result.upstream}; rounds: {result.this.rounds_per_second} vs "
        f"{result.other.rounds_per_second} req/s)",
    )
    return Report(tables=(table,), notes=notes)
