"""`fauxmad torture`: parse the options, run `lab.torture` (a nemesis over a local fleet), print the verdict.

Exit 0 when the history shows no violation, 1 when it shows any (each printed with its evidence), 2 for a
bad option (an unknown fault kind, a malformed duration).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.text import Text

from orchestrator.cli.render import make_console
from orchestrator.cli.runtime import EXIT_FAILED, EXIT_USAGE, fail

FAULTS_HELP = (
    "comma-separated fault kinds: kill (worker kill -9), freeze (SIGSTOP a worker's host), nats, broker, operator,"
    " cpu (the whole host starved by stress-ng, only where it is installed);"
    " with --hosts also cut (a host's link, both ways), oneway (a host's outgoing packets dropped), flap (its link"
    " down and up), latency (its link slowed), skew (a worker's clock +3s or -30s); with --hosts supercluster also"
    " region (a region's gateways cut). Default: every kind the topology offers"
)
HOSTS_HELP = (
    "run on hosts of their own (root, Linux: network namespaces on a bridge): cluster (3 hosts, a 3-server NATS"
    " cluster) or supercluster (3 regions, one host each, gateways between them)"
)
GAP_HELP = (
    "the least time between two faults' starts (the most: twice it); a shorter one fits every kind in less time"
    " (default: 5s, 2s with --hosts)"
)
SEED_HELP = "the seed of the fault schedule and the clients' steps (default: a random one, printed)"
KEEP_HELP = (
    "keep the run directory here (history.jsonl, every process's log); default: a temporary one, removed unless"
    " the run found violations"
)


def _parse_seconds(option: str, text: str, example: str) -> float:
    """`--duration`/`--gap`: seconds or a duration string, at least 1 s; else exit 2 naming the option."""
    from bus.contract.base import seconds

    try:
        value = seconds(float(text) if text.replace(".", "", 1).isdigit() else text)
    except ValueError:
        fail(f"invalid {option} {text!r}: use seconds or a string like {example}", EXIT_USAGE)
    if value < 1:
        fail(f"{option} {text} is too short: at least 1s", EXIT_USAGE)
    return value


def _offered(hosts: str | None) -> tuple[str, ...]:
    """The fault kinds a topology offers."""
    from lab.torture.plan import FAULT_KINDS, HOST_FAULT_KINDS, REGION_FAULT_KINDS

    if hosts is None:
        return FAULT_KINDS
    return FAULT_KINDS + HOST_FAULT_KINDS + (REGION_FAULT_KINDS if hosts == "supercluster" else ())


def _parse_faults(text: str | None, hosts: str | None, progress: Callable[[str], None]) -> tuple[str, ...]:
    from lab.torture.fleet import stress_ng

    offered = _offered(hosts)
    if text is None:  # the default: every kind this topology offers and this host can inject
        if stress_ng() is None:
            progress("stress-ng is not installed: no cpu fault (Debian: apt-get install stress-ng)")
            return tuple(kind for kind in offered if kind != "cpu")
        return offered
    chosen = [kind.strip() for kind in text.split(",") if kind.strip()]
    from lab.torture.plan import ALL_FAULT_KINDS

    unknown = [kind for kind in chosen if kind not in ALL_FAULT_KINDS]
    if unknown:
        fail(f"unknown fault kind {', '.join(unknown)}: use {', '.join(ALL_FAULT_KINDS)}", EXIT_USAGE)
    elsewhere = [kind for kind in chosen if kind not in offered]
    if elsewhere:
        where = "--hosts supercluster" if elsewhere == ["region"] else "--hosts"
        fail(f"fault kind {', '.join(elsewhere)} needs {where}", EXIT_USAGE)
    if "cpu" in chosen and stress_ng() is None:
        fail("the cpu fault needs stress-ng, which is not installed (Debian: apt-get install stress-ng)", EXIT_USAGE)
    return tuple(dict.fromkeys(chosen))


def _parse_hosts(text: str | None) -> str | None:
    if text is None:
        return None
    if text not in ("cluster", "supercluster"):
        fail(f"invalid --hosts {text!r}: use cluster or supercluster", EXIT_USAGE)
    from orchestrator.devhosts import unavailable

    reason = unavailable()
    if reason is not None:
        fail(f"--hosts cannot run here: {reason}", EXIT_USAGE)
    return text


def torture(
    seed: int | None = typer.Option(None, "--seed", help=SEED_HELP, show_default=False),
    duration: str = typer.Option("90s", "--duration", help="how long the workload and the faults run (90s, 2m, 45)"),
    faults: str | None = typer.Option(None, "--faults", help=FAULTS_HELP, show_default=False),
    hosts: str | None = typer.Option(None, "--hosts", help=HOSTS_HELP, show_default=False),
    gap: str | None = typer.Option(None, "--gap", help=GAP_HELP, show_default=False),
    json_out: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
    keep: Path | None = typer.Option(None, "--keep", help=KEEP_HELP, show_default=False),
) -> None:
    """Torture a local fleet and check what it did (a Jepsen-style nemesis).

    Starts a real fleet on this host (nats-server with JetStream, 4 workers in 2 regions, 2 brokers, the
    operator keeping an app with a primary and a spare per region) and runs 5 clients (each its own app:
    create with idempotency keys, start, stop, destroy, leases) while a seeded nemesis strikes every 5-10 s
    (--gap): kill -9 of a worker, a broker, the operator or nats-server (each restarted), SIGSTOP of a
    worker's host for 3-8 s, or the whole host starved of CPU for 3-8 s (stress-ng); some kills and freezes
    strike the moment a reserve goes out to the worker. Then the
    fleet settles, a final snapshot is taken, the operator must replace a primary destroyed under it, and
    the history is checked: nothing acknowledged lost, one machine per key, no machine running twice, no
    overcommit, the workers' registries matching the processes, the last acknowledged action holding,
    no doubled lease, the operator's app at its count and never taken down by a stop it asked for.

    With --hosts, the fleet runs on hosts of their own (network namespaces on a bridge; root, Linux) and the
    nemesis also cuts links both ways and one way, flaps them, slows them, restarts a worker under a skewed
    clock and, in a supercluster, cuts a region off; three more checks: an acknowledged create on the minority
    side is never lost, one running copy of each machine after every heal, and a cut-off region goes on
    placing and serving its own traffic. Every enabled kind strikes at least once per run.

    The same seed attempts the same faults and client steps. Exit 0: no violation; 1: violations (the run
    directory is kept); 2: a bad option.
    """
    from lab.torture.fleet import TortureError
    from lab.torture.run import TortureOptions, render, run
    from orchestrator.cli.render import print_json

    stderr = make_console(stderr=True)

    def progress(line: str) -> None:
        stderr.print(Text(f"… {line}", style="dim"))

    chosen_seed = seed if seed is not None else random.SystemRandom().randrange(1, 1_000_000)
    topology = _parse_hosts(hosts)
    options = TortureOptions(
        seed=chosen_seed,
        duration=_parse_seconds("--duration", duration, "'90s' or '2m'"),
        faults=_parse_faults(faults, topology, progress),
        gap=_parse_seconds("--gap", gap, "'5s'") if gap is not None else None,
        keep=keep,
        topology=topology or "local",
    )
    progress(f"seed {chosen_seed}")
    try:
        result = run(options, progress)
    except TortureError as exc:
        fail(str(exc), EXIT_FAILED)
    if json_out:
        print_json(result)
    else:
        sys.stdout.write(render(result))
    if not result.ok:
        raise typer.Exit(EXIT_FAILED)
