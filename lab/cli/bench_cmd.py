"""`fauxmad bench placement|worker|deploy|failover|api|proxy|peer`: parse options, call `lab.bench`, render.

Each command runs one benchmark from the library, shows its report (rich tables on a terminal, plain
aligned text when stdout is a pipe or a file, so nothing is cut at 80 columns) and writes the result as
JSON. Progress goes to stderr. Numbers belong in notes, not tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import typer
from rich import box
from rich.table import Table
from rich.text import Text

from lab.bench import BenchError
from lab.bench.report import Report, plain
from orchestrator.cli.render import console, make_console, print_json
from orchestrator.cli.runtime import EXIT_USAGE, fail, nats_option

T = TypeVar("T")

bench_app = typer.Typer(
    help="Measure placement, workers, deploys, failover, and a peer (prints percentiles, writes JSON).",
    no_args_is_help=True,
)

_stderr = make_console(stderr=True)

OUTPUT_HELP = "where to write the JSON"
JSON_HELP = "print the JSON result instead of the tables"


def _progress(line: str) -> None:
    _stderr.print(Text(f"… {line}", style="dim"))


def show(report: Report) -> None:
    """Rich tables on a terminal; plain aligned text otherwise (a pipe, a file: no box, nothing cut)."""
    if not console.is_terminal:
        sys.stdout.write(plain(report))
        return
    for spec in report.tables:
        table = Table(title=spec.title or None, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
        for name, side in zip(spec.columns, spec.align, strict=True):
            table.add_column(name, no_wrap=True, justify="right" if side == "r" else "left")
        for row in spec.rows:
            table.add_row(*(Text(cell) for cell in row))
        console.print(table)
    for note in report.notes:
        console.print(Text(note))


def _finish(result: Any, report: Report, output: Path, json_out: bool) -> None:
    output.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2) + b"\n")
    if json_out:
        print_json(result)
        return
    show(report)
    print(f"wrote {output}")


def _measure(run: Callable[[], T]) -> T:
    try:
        return run()
    except BenchError as exc:
        fail(str(exc))


def _compare(run: Callable[[], T], report: Callable[[T], Report], output: Path, json_out: bool) -> None:
    """A bench's `--against REV` run: a REV that names no commit is a usage error (exit 2), as in every bench."""
    from lab.bench.against import BadRevision

    def measured() -> T:
        try:
            return run()
        except BadRevision as exc:
            fail(str(exc), EXIT_USAGE)

    compared = _measure(measured)
    _finish(compared, report(compared), output, json_out)


@bench_app.command("placement")
def placement(
    workers: int = typer.Option(10, "--workers", min=1, max=5000, help="workers per region"),
    regions_count: int = typer.Option(1, "--regions", min=1, max=20, help="number of regions"),
    strategy: str = typer.Option(
        "scatter", "--strategy", help="scatter, p2c, hedged or replica (docs/explanation/placement.md)"
    ),
    concurrency: int = typer.Option(1, "--concurrency", "-c", min=1, max=1024, help="creates in flight"),
    count: int = typer.Option(2000, "--count", "-n", min=1, help="creates to measure"),
    start: bool = typer.Option(False, "--start", help="create and start a process machine (default: reserve only)"),
    warmup: int = typer.Option(100, "--warmup", min=0, help="creates before measuring"),
    brokers: int = typer.Option(1, "--brokers", min=1, max=8, help="broker processes"),
    per_process: int = typer.Option(
        0,
        "--workers-per-process",
        min=0,
        max=5000,
        help="logical workers per worker process [default: 1 up to 16 workers]",
    ),
    echo_count: int = typer.Option(500, "--echo-count", min=1, help="bus round trips to measure"),
    supercluster: int = typer.Option(
        0,
        "--supercluster",
        min=0,
        max=5,
        help="N > 0: measure on one server, then on a loopback supercluster of N servers per region (each region's"
        " creates through its own servers), in the same run",
    ),
    wan_delay: float = typer.Option(
        0.0,
        "--wan-delay",
        min=0.0,
        max=5.0,
        help="with --supercluster: seconds one way added on every gateway link between regions (a WAN: the relay of"
        " bus/local/gateway_relay.py); each region's creates are also shown on their own",
    ),
    floor: bool = typer.Option(
        False,
        "--floor",
        help="also measure the floor in the same run, on the same nats-server: the same protocol in plain nats-py"
        " (one responder process per worker: an offer, a reserve = one fsync'd LMDB put + one JetStream publish;"
        " a client that scatters, gathers with the broker's 50 ms deadline, picks the most free, reserves), in"
        " rounds alternating with fauxmad's, at c=1 and at --concurrency; prints both, their ratios, and the CPU"
        " per create of each side's processes (reserve only); and the contract's floors (--no-contract: not them)",
    ),
    contract: bool = typer.Option(
        True,
        "--contract/--no-contract",
        help="with --floor: also the floor with the contract's parts, in plain nats-py too: a broker process between"
        " the client and the responders and the routing index entry stored before the reply ('contract'), and"
        " also the audit record in a stream of its own and the broker following the index ('contract+audit');"
        " prints what those parts cost over the floor, and fauxmad over them",
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        metavar="REV",
        help="also measure git revision REV (a tag such as v0.1.0, a commit, HEAD~1) in the same run: REV is"
        " built in a temporary git worktree into a virtualenv of its own (kept under"
        " ~/.cache/fauxmad/bench-against/<commit>, so the next run starts at once), then rounds alternate between"
        " this tree's bench and REV's, each with a fleet of its own, at c=1 and at --concurrency; prints both"
        " (the median of the rounds) and this tree's ratios to REV's: p50, p99, throughput",
    ),
    against_workers: int | None = typer.Option(
        None,
        "--against-workers",
        metavar="N",
        min=1,
        max=5000,
        help="also measure a fleet of N workers per region in the same run: rounds alternate between --workers'"
        " fleet and N's, each round on a fleet of its own (started, warmed up, measured, stopped), --count creates"
        " a size split over --rounds; prints each size's percentiles (samples pooled) and creates/s, each round's"
        " p50/p99, and --workers' ratios to N's: p99, p50, throughput (e.g. --workers 1000 --against-workers 10)",
    ),
    rounds: int = typer.Option(
        4,
        "--rounds",
        min=1,
        max=100,
        help="with --floor, --against or --against-workers: alternating rounds per concurrency or size (--count is"
        " split over them)",
    ),
    nats: str | None = nats_option("; given: use that fleet"),
    output: Path = typer.Option(Path("bench-placement.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Create latency (p50/p90/p99/max) and throughput, with the bus round trip (echo in another process).

    --floor compares fauxmad with the same protocol in plain nats-py, in one run; --against REV compares this
    tree with another git revision, in one run; --against-workers N compares two fleet sizes, in one run."""
    from lab.bench import placement as bench
    from orchestrator.broker.auction import STRATEGIES

    if strategy not in STRATEGIES:
        fail(f"unknown --strategy {strategy!r}: use one of {', '.join(STRATEGIES)}", EXIT_USAGE)
    options = bench.PlacementOptions(
        workers=workers,
        regions=regions_count,
        strategy=strategy,
        concurrency=concurrency,
        count=count,
        start=start,
        warmup=warmup,
        brokers=brokers,
        workers_per_process=per_process,
        nats=nats,
        echo_count=echo_count,
        supercluster=supercluster,
        wan_delay=wan_delay,
    )
    if wan_delay and not supercluster:
        fail("--wan-delay is the delay between a supercluster's regions: give --supercluster too", EXIT_USAGE)
    if against_workers is not None:
        if against is not None or floor or nats is not None or supercluster:
            fail(
                "--against-workers starts fleets of its own: leave out --against, --floor, --nats and --supercluster",
                EXIT_USAGE,
            )
        _sizes(options, against_workers, rounds, output, json_out)
        return
    if against is not None:
        from lab.bench import against as versus

        if floor or nats is not None or supercluster:
            fail("--against starts fleets of its own: leave out --floor, --nats and --supercluster", EXIT_USAGE)
        rev = versus.AgainstOptions(rev=against, placement=options, rounds=rounds)
        _compare(lambda: versus.run_against(rev, _progress), versus.report, output, json_out)
        return
    if floor:
        from lab.bench import floor_run

        if nats is not None or supercluster or start:
            fail(
                "--floor measures reserve only on a fleet of its own: leave out --nats, --supercluster, --start",
                EXIT_USAGE,
            )
        floored = _measure(
            lambda: floor_run.run_floor(
                floor_run.FloorOptions(placement=options, rounds=rounds, contract=contract), _progress
            )
        )
        _finish(floored, floor_run.report(floored), output, json_out)
        return
    if supercluster:
        if nats is not None:
            fail("--supercluster starts its own fleets: leave out --nats", EXIT_USAGE)
        compared = _measure(lambda: bench.run_comparison(options, _progress))
        _finish(compared, bench.comparison_report(compared), output, json_out)
        return
    result = _measure(lambda: bench.run_placement(options, _progress))
    _finish(result, bench.report(result), output, json_out)


def _sizes(options: Any, against_workers: int, rounds: int, output: Path, json_out: bool) -> None:
    """`bench placement --against-workers N`: two fleet sizes in one run (lab.bench.sizes)."""
    from lab.bench import sizes

    if against_workers == options.workers:
        fail(f"--against-workers {against_workers} is the size --workers gives: give another size", EXIT_USAGE)
    sized = _measure(
        lambda: sizes.run_sizes(
            sizes.SizesOptions(placement=options, against_workers=against_workers, rounds=rounds), _progress
        )
    )
    _finish(sized, sizes.report(sized), output, json_out)


@bench_app.command("worker")
def worker(
    reserves: int = typer.Option(2000, "--reserves", min=10, help="sequential reserves over NATS"),
    records: str = typer.Option("100000,1000000", "--records", help="log sizes for the restart measurement"),
    output: Path = typer.Option(Path("bench-worker.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Reserve latency over NATS, commits/s with fsync, restart time vs log size, worker RSS at rest."""
    from lab.bench.worker import report
    from lab.cli import worker_bench  # the one edge into `workers` for benchmarks

    try:
        sizes = [int(part) for part in records.split(",") if part.strip()]
    except ValueError:
        fail(f"invalid --records {records!r}: use numbers like 100000,1000000", EXIT_USAGE)
    result = _measure(lambda: worker_bench.run(reserves=reserves, sizes=sizes, progress=_progress))
    _finish(result, report(result), output, json_out)


@bench_app.command("deploy")
def deploy(
    regions: str = typer.Option("mad,syd,gru", "--regions", help="comma-separated regions"),
    machines: int = typer.Option(10, "--machines", min=1, max=200, help="machines per region"),
    workers: int = typer.Option(4, "--workers-per-region", min=1, max=20),
    strategy: str = typer.Option("rolling", "--strategy", help="rolling, canary, bluegreen or immediate"),
    max_unavailable: str = typer.Option("0.33", "--max-unavailable", help="a fraction or a count"),
    output: Path = typer.Option(Path("bench-deploy.json"), "--output", "--out", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Time a first deploy and a new release (every machine updated) across regions, with http checks."""
    from lab.bench import deploy as bench
    from orchestrator.cli.runtime import split_names

    names = split_names("region", regions)
    if not names:
        fail("--regions needs at least one region", EXIT_USAGE)
    if strategy not in bench.STRATEGIES:
        fail(f"unknown --strategy {strategy!r}: use one of {', '.join(bench.STRATEGIES)}", EXIT_USAGE)
    options = bench.DeployOptions(
        regions=names, machines=machines, workers=workers, strategy=strategy, max_unavailable=max_unavailable
    )
    result = _measure(lambda: bench.run_deploy(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("failover")
def failover(
    rounds: int = typer.Option(3, "--rounds", min=1, max=50, help="hosts to kill, one after another"),
    workers: int = typer.Option(3, "--workers-per-region", min=2, max=20),
    machines: int = typer.Option(2, "--machines", min=1, max=50, help="primaries (each with one spare)"),
    output: Path = typer.Option(Path("bench-failover.json"), "--output", "--out", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Kill a host while `reconcile --watch` runs; time until its primaries' spares are started."""
    from lab.bench import failover as bench

    options = bench.FailoverOptions(rounds=rounds, workers=workers, machines=machines)
    result = _measure(lambda: bench.run_failover(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("api")
def api(
    creates: int = typer.Option(200, "--creates", min=1, max=5000, help="creates each way (HTTP and NATS)"),
    gets: int = typer.Option(5000, "--gets", min=1, max=1_000_000, help="gets through the API for req/s"),
    concurrency: int = typer.Option(32, "--concurrency", min=1, max=1024),
    output: Path = typer.Option(Path("bench-api.json"), "--output", "--out", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """HTTP create latency vs the NATS create in the same run, and requests/s on one API process."""
    from lab.bench import api as bench

    options = bench.ApiOptions(creates=creates, gets=gets, concurrency=concurrency)
    result = _measure(lambda: bench.run_api(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("console")
def console_bench(
    machines: int = typer.Option(1000, "--machines", min=1, max=20_000, help="machines (reserve only) in the fleet"),
    workers: int = typer.Option(50, "--workers", min=1, max=500, help="workers, spread over the regions"),
    regions: int = typer.Option(5, "--regions", min=1, max=20),
    loads: int = typer.Option(20, "--loads", min=1, max=1000, help="loads of the fleet page measured"),
    events: int = typer.Option(20, "--events", min=1, max=1000, help="actions whose event is timed to the screen"),
    output: Path = typer.Option(Path("bench-console.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The web console in Debian's Chromium: the fleet page's first paint, and an event's time to the screen."""
    from lab.bench import console as bench

    options = bench.ConsoleOptions(machines=machines, workers=workers, regions=regions, loads=loads, events=events)
    result = _measure(lambda: bench.run_console(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("secure")
def secure(
    creates: int = typer.Option(500, "--creates", "-n", min=1, max=100_000, help="measured creates on each fleet"),
    workers: int = typer.Option(3, "--workers", min=1, max=50, help="workers in each fleet"),
    warmup: int = typer.Option(50, "--warmup", min=0, help="creates on each fleet before measuring"),
    output: Path = typer.Option(Path("bench-secure.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """What security costs a create: an open and a secure fleet (mutual TLS, an identity per process,
    permissions enforced by nats-server) side by side, creates alternating between them."""
    from lab.bench import secure as bench

    options = bench.SecureOptions(creates=creates, workers=workers, warmup=warmup)
    result = _measure(lambda: bench.run_secure_bench(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("proxy")
def proxy(
    requests: int = typer.Option(2000, "--requests", "-n", min=10, max=1_000_000, help="GETs each way, one at a time"),
    concurrency: int = typer.Option(32, "--concurrency", "-c", min=1, max=1024, help="keep-alive clients for req/s"),
    seconds: float = typer.Option(3.0, "--seconds", min=0.5, max=600, help="how long to measure req/s"),
    wakes: int = typer.Option(10, "--wakes", min=1, max=1000, help="requests to a suspended and to a stopped machine"),
    against: str | None = typer.Option(
        None,
        "--against",
        metavar="REV",
        help="also run REV's proxy (a git revision, exported with git archive) beside this tree's, on the same"
        " fleet and machine, in alternating rounds: overhead and req/s side by side (wakes are not timed)",
    ),
    rounds: int = typer.Option(4, "--rounds", min=1, max=100, help="with --against: rounds (--requests is split)"),
    backhaul: bool = typer.Option(
        False, "--backhaul", help="reach the machine through its worker's backhaul, as an edge on another host does"
    ),
    hosts: bool = typer.Option(
        False,
        "--hosts",
        help="across hosts (root, Linux: network namespaces on a bridge): the edge on host a, the machine on host b",
    ),
    output: Path = typer.Option(Path("bench-proxy.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The edge: GET latency direct vs through `fauxmad proxy`, req/s through one proxy process, and the first
    byte when the machine is suspended (resumed) or stopped (started) inside the request."""
    from lab.bench import proxy as bench

    if hosts:
        from orchestrator.devhosts import unavailable

        if against is not None or backhaul:
            fail("--hosts measures the edge of a fleet of hosts: not with --against or --backhaul", EXIT_USAGE)
        if (reason := unavailable()) is not None:
            fail(f"--hosts cannot run here: {reason}", EXIT_USAGE)
    options = bench.ProxyOptions(
        requests=requests, concurrency=concurrency, seconds=seconds, wakes=wakes, backhaul=backhaul, hosts=hosts
    )
    if against is not None:
        from lab.bench import proxy_against as versus

        _compare(lambda: versus.run_proxy_against(options, against, rounds, _progress), versus.report, output, json_out)
        return
    result = _measure(lambda: bench.run_proxy_bench(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("peer")
def peer(
    count: int = typer.Option(200, "--count", "-n", min=1, max=100_000, help="of each kind, measured"),
    warmup: int = typer.Option(10, "--warmup", min=0, help="of each kind, before measuring"),
    workers: int = typer.Option(10, "--workers", min=1, max=100, help="fauxmad workers (one region)"),
    ray_cpus: int = typer.Option(2, "--ray-cpus", min=1, max=1024, help="CPUs Ray gets (ray.init num_cpus)"),
    output: Path = typer.Option(Path("bench-peer.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """fauxmad and Ray on this machine, one after the other, c=1: create vs a 1-CPU placement group,
    create+start vs a 1-CPU actor. Needs the `peers` extra (Ray)."""
    from lab.bench import peer as bench

    if not bench.ray_available():
        fail(f"`fauxmad bench peer` needs Ray: {bench.INSTALL_HINT}", EXIT_USAGE)
    options = bench.PeerOptions(count=count, warmup=warmup, workers=workers, ray_cpus=ray_cpus)
    result = _measure(lambda: bench.run_peer(options, _progress))
    _finish(result, bench.report(result), output, json_out)


@bench_app.command("jobs")
def jobs(
    tasks: int = typer.Option(1000, "--tasks", "-n", min=1, max=10_000, help="tasks in the throughput burst"),
    samples: int = typer.Option(200, "--samples", min=1, max=10_000, help="tasks one at a time (free capacity)"),
    workers: int = typer.Option(4, "--workers", min=1, max=64, help="worker processes, for every system"),
    slots: int = typer.Option(4, "--slots", min=1, max=256, help="tasks at a time per worker"),
    runner: str = typer.Option("process", "--runner", help="fauxmad's: process (the fast path) or machine"),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="also Redis BLPOP and arq"),
    nats_sync: bool = typer.Option(
        True, "--nats-sync/--no-nats-sync", help="fauxmad's NATS flushes every write (as shipped), or NATS's default"
    ),
    against: str | None = typer.Option(
        None,
        "--against",
        metavar="REV",
        help="also measure git revision REV (a tag, a commit, HEAD~1) in the same run: REV is built into a"
        " virtualenv of its own as `bench placement --against` builds it, then rounds alternate between this"
        " tree's fauxmad and REV's (no baselines), each with a fleet of its own; prints both (the median of the"
        " rounds) and this tree's ratios to REV's",
    ),
    rounds: int = typer.Option(4, "--rounds", min=1, max=100, help="with --against: rounds per side"),
    output: Path = typer.Option(Path("bench-jobs.json"), "--output", "-o", help=OUTPUT_HELP),
    json_out: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Background jobs: tasks/s and scheduling delay p50/p99, fauxmad beside Redis BLPOP (the seed's
    baseline) and arq, one after the other in one run. The baselines need redis-server (Debian) and the
    `jobs-bench` extra; without them they are skipped, with a line saying so. --against REV compares this
    tree's fauxmad with another git revision's, in one run."""
    from lab.bench import jobs as bench

    if runner not in ("process", "machine"):
        fail(f"invalid --runner {runner!r}: use process or machine", EXIT_USAGE)
    options = bench.JobsBenchOptions(
        tasks=tasks,
        samples=samples,
        workers=workers,
        slots=slots,
        runner=runner,
        baselines=baselines,
        nats_sync=nats_sync,
    )
    if against is not None:
        from lab.bench import jobs_against as versus

        _compare(lambda: versus.run_jobs_against(options, against, rounds, _progress), versus.report, output, json_out)
        return
    result = _measure(lambda: bench.run_jobs_bench(options, _progress))
    for line in result.skipped:
        _stderr.print(Text(f"note: {line}", style="yellow"))
    _finish(result, bench.jobs_report(result), output, json_out)
