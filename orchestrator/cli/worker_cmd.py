"""`fauxmad worker`: run the worker agent on this host (the CLI's one permitted edge into `workers`)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from bus.local.embedded import EmbeddedNats
from bus.local.ports import PortRange
from orchestrator.cli.runtime import (
    EXIT_USAGE,
    MetricsOption,
    NatsOption,
    WorkerIdArgument,
    check_region,
    check_worker_id,
    fail,
    nats_url,
    serve,
    serve_metrics,
    shown_url,
)

if TYPE_CHECKING:
    from workers.agent.config import WorkerConfig


def default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64].strip("-")
    return host or "worker"


def host_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 1024


def machine_user(value: str | None) -> tuple[int, int] | None:
    """`--machine-user NAME`, `UID` or `UID:GID` as (uid, gid); a user name gives its primary group."""
    if value is None:
        return None
    import pwd

    name, _, group = value.partition(":")
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        if not name.isdigit():
            fail(f"--machine-user: no user {name!r} on this host", EXIT_USAGE)
        uid, gid = int(name), int(name)  # a bare uid with no passwd entry: its own group
    if group:
        if not group.isdigit():
            fail(f"--machine-user: the group in {value!r} must be a number (UID:GID)", EXIT_USAGE)
        gid = int(group)
    if uid == 0:
        fail("--machine-user: machines must not run as root (uid 0)", EXIT_USAGE)
    if os.geteuid() != 0:
        fail("--machine-user needs the worker to run as root (it switches each machine to that user)", EXIT_USAGE)
    return uid, gid


def _check_searchable(data_dir: Path) -> None:
    """Machines run as another user reach their directories under the data dir: every folder above it
    must let others pass (o+x), or every machine would fail to start."""
    for parent in data_dir.absolute().parents:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            fail(
                f"--machine-user: {parent} does not let others pass (chmod o+x), so machines could not "
                "reach their directories under --data-dir (use a data dir such as /var/lib/fauxmad)",
                EXIT_USAGE,
            )


def default_data_dir(worker_id: str) -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fauxmad" / "workers" / worker_id


worker_app = typer.Typer(
    help="Run a worker agent on this host (with no subcommand), or drain and cordon workers.",
    invoke_without_command=True,
)


@worker_app.callback()
def worker(
    ctx: typer.Context,
    nats: str | None = NatsOption,
    region: str = typer.Option("local", "--region", "-r", help="the region this worker serves", callback=check_region),
    worker_id: str | None = typer.Option(
        None, "--worker-id", help="unique id [default: the host name]", callback=check_worker_id
    ),
    cpus: int | None = typer.Option(None, "--cpus", min=1, help="cpus to offer [default: the host's]"),
    memory_mb: int | None = typer.Option(None, "--memory-mb", min=1, help="memory to offer [default: the host's]"),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="LMDB and machine files [default: ~/.local/share/fauxmad/workers/ID]"
    ),
    heartbeat: float = typer.Option(1.0, "--heartbeat", min=0.1, help="seconds between heartbeats"),
    restart_backoff: float = typer.Option(0.5, "--restart-backoff", min=0.0, help="first restart delay, seconds"),
    no_fsync: bool = typer.Option(False, "--no-fsync", help="skip fsync on commit (benchmarks only: unsafe)"),
    secrets_key: Path | None = typer.Option(
        None,
        "--secrets-key",
        envvar="FAUXMAD_SECRETS_KEY",
        help="a file with the fleet's secrets key (see `fauxmad secrets`): apps with secrets start only with it",
        show_default=False,
    ),
    metrics_listen: str | None = MetricsOption,
    volume_capacity_gb: int = typer.Option(
        0,
        "--volume-capacity-gb",
        min=0,
        help="GB of volumes this worker may hold (sizes summed; 0: the data dir's free disk when it starts)",
    ),
    image_cache_mb: int = typer.Option(
        4096, "--image-cache-mb", min=1, help="disk for unpacked images (least recently used go first)"
    ),
    run_machines_as: str | None = typer.Option(
        None,
        "--machine-user",
        help="run machines as this user (NAME, UID or UID:GID; the worker runs as root), so they cannot read "
        "the worker's credentials or data; sandboxed machines keep their namespaces' view",
        show_default=False,
    ),
    job_slots: int = typer.Option(
        0, "--job-slots", min=0, help="background jobs run at once [default: one per cpu offered]", show_default=False
    ),
    max_load: float = typer.Option(
        8.0,
        "--max-load",
        min=0.0,
        help="decline offers while the 1-minute load average per cpu is at least this (0: never; a dev fleet, "
        "whose simulated hosts share one kernel, uses 0)",
    ),
    jobs_ack_wait: float = typer.Option(
        6.0, "--jobs-ack-wait", min=0.5, help="seconds before a job taken by a silent worker goes to another"
    ),
    advertise: str | None = typer.Option(
        None,
        "--advertise",
        envvar="FAUXMAD_ADVERTISE",
        help="the IP address other hosts reach this worker at (its backhaul listens there) [default: the local "
        "address of its NATS connection; loopback when NATS is on loopback]",
        show_default=False,
    ),
    backhaul_port: int = typer.Option(
        0,
        "--backhaul-port",
        envvar="FAUXMAD_BACKHAUL_PORT",
        min=0,
        max=65535,
        help="the port of the backhaul, where edge proxies on other hosts reach this host's machines [default: a "
        "free port, advertised in the heartbeat]",
        show_default=False,
    ),
    machine_ports: str | None = typer.Option(
        None,
        "--machine-ports",
        envvar="FAUXMAD_MACHINE_PORTS",
        metavar="LOW-HIGH",
        help="the ports machines are given as PORT [default: the upper half of 10000 up to the kernel's ephemeral "
        "range, or of $FAUXMAD_PORT_RANGE]; two workers on one host (or loopback) each take a range of their own",
        show_default=False,
    ),
    count: int = typer.Option(
        1,
        "--count",
        min=1,
        max=2000,
        hidden=True,
        help="run COUNT logical workers ID-0000.. in this process (benchmarks)",
    ),
) -> None:
    """Run a worker agent: the source of truth for the machines on this host.

    It answers auctions on fauxmad.v1.offers.REGION, serves fauxmad.v1.worker.ID.machines.VERB, and
    beats its heart into KV fauxmad_workers. Stopping it (or kill -9) leaves its machines running;
    a restart re-adopts them.
    """
    if ctx.invoked_subcommand is not None:
        return  # `fauxmad worker drain ...`: the options above belong to running an agent
    from workers.agent.config import WorkerConfig
    from workers.lifecycle.restart_policy import Backoff
    from workers.offers import Backpressure

    serve_metrics(metrics_listen)
    if advertise is not None:
        advertise = _check_advertise(advertise)
    port_range = _check_machine_ports(machine_ports)
    wid = worker_id if worker_id is not None else default_worker_id()
    url = nats_url(nats, required=False)
    server = None
    if url is None:
        server = EmbeddedNats().start()
        url = server.url
        typer.echo(f"no --nats given: started an embedded nats-server at {url}", err=True)
    root = data_dir or default_data_dir(wid)
    key = _read_secrets_key(secrets_key)
    run_as = machine_user(run_machines_as)
    if run_as is not None:
        _check_searchable(root)
    ids = [wid] if count == 1 else [f"{wid}-{i:04d}" for i in range(count)]
    configs = [
        WorkerConfig(
            nats_url=url,
            region=region,
            worker_id=one,
            cpus=cpus or os.cpu_count() or 1,
            memory_mb=memory_mb or host_memory_mb(),
            data_dir=str(root if count == 1 else root / one),
            heartbeat_interval=heartbeat,
            backoff=Backoff(base=restart_backoff),
            backpressure=Backpressure(max_load=max_load),
            fsync=not no_fsync,
            map_size=(8 << 30) if count == 1 else (64 << 20),
            secrets_key=key,
            image_cache_mb=image_cache_mb,
            machine_user=run_as,
            volume_capacity_gb=volume_capacity_gb or None,
            job_slots=job_slots,
            jobs_ack_wait=jobs_ack_wait,
            advertise=advertise,
            backhaul_port=backhaul_port if count == 1 else 0,
            machine_ports=port_range,
        )
        for one in ids
    ]
    try:
        serve(_serve(configs), what="worker")
    finally:
        if server is not None:
            server.stop()


def _register_subcommands() -> None:
    from orchestrator.cli import drain_cmd

    worker_app.command("drain")(drain_cmd.drain)

    @worker_app.command("cordon")
    def cordon(
        worker_id: str = WorkerIdArgument,
        nats: str | None = NatsOption,
    ) -> None:
        """Place no new machines on a worker; what runs there keeps running."""
        drain_cmd.cordon(worker_id, uncordon=False, nats=nats)

    @worker_app.command("uncordon")
    def uncordon(
        worker_id: str = WorkerIdArgument,
        nats: str | None = NatsOption,
    ) -> None:
        """Let a cordoned worker take new machines again."""
        drain_cmd.cordon(worker_id, uncordon=True, nats=nats)


_register_subcommands()


def _check_machine_ports(value: str | None) -> PortRange | None:
    """`--machine-ports LOW-HIGH`, or a one-line error naming what is wrong."""
    if value is None:
        return None
    try:
        return PortRange.parse(value)
    except ValueError as exc:
        fail(f"--machine-ports: {exc}", EXIT_USAGE)


def _check_advertise(value: str) -> str:
    """`--advertise`: an IP address of this host (the backhaul binds it), else one line and exit 2."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        fail(f"--advertise {value!r}: not an IP address (give the address other hosts reach this one at)", EXIT_USAGE)


def _read_secrets_key(path: Path | None) -> str | None:
    """The key in `path` (checked), or None; a missing or malformed file is one line and exit 2."""
    if path is None:
        return None
    from bus.stores.secrets import load_private_key

    try:
        text = path.read_text()
        load_private_key(text)
    except OSError as exc:
        fail(f"--secrets-key {path}: {exc.strerror or exc}", EXIT_USAGE)
    except ValueError as exc:
        fail(f"--secrets-key {path}: {exc}", EXIT_USAGE)
    return text.strip()


async def _serve(configs: list[WorkerConfig]) -> None:
    """`workers.agent.runner.run_workers`, saying what each worker serves once they all do, and what they leave
    running once they stop."""
    from bus.contract import subjects
    from workers.agent.runner import run_workers  # imported here: other commands start faster

    def ready() -> None:
        first = configs[0]
        names = first.worker_id if len(configs) == 1 else f"{len(configs)} workers ({first.worker_id}, ...)"
        print(
            f"fauxmad worker {names}: serving {subjects.PREFIX}.worker.<id>.> and region {first.region}'s jobs"
            f" on {shown_url(first.nats_url)} ({first.cpus} cpus, {first.memory_mb} MB each; data in"
            f" {first.data_dir})",
            flush=True,
        )

    def stopped(running: int) -> None:
        print(
            f"fauxmad worker: stopped; {running} machine{'s' if running != 1 else ''} left running (a worker started"
            " with the same --worker-id and --data-dir adopts them)",
            flush=True,
        )

    await run_workers(configs, ready, stopped)
