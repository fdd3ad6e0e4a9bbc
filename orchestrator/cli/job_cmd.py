"""`fauxmad job submit|status|list|cancel|logs|wait`: background jobs (docs/how-to/jobs.md).

Parse, call `orchestrator.jobs.client.JobsClient`, render. A job's output is printed verbatim (never
through rich), like a machine's logs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import typer
from rich import box

from bus.contract.jobs import Job
from orchestrator.cli.render import KEYS, FitTable, WideOption, console, print_json
from orchestrator.cli.runtime import (
    EXIT_FAILED,
    EXIT_USAGE,
    JsonOption,
    NatsOption,
    check_app,
    check_region,
    fail,
    key_values,
    with_client,
    with_connected,
)

if TYPE_CHECKING:
    from orchestrator.jobs.client import JobsClient

T = TypeVar("T")

job_app = typer.Typer(
    help="Background jobs: run a command to completion once, on whichever worker of a region has room.",
    no_args_is_help=True,
)

AppOption = typer.Option(..., "--app", "-a", help="the app the job belongs to", callback=check_app)
JobIdArgument = typer.Argument(..., help="job id (j + 15 hex, as `job submit` printed it)")


def _client(url: str | None, fn: Callable[[JobsClient], Awaitable[T]]) -> T:
    """Run `fn` with a `JobsClient` connected to the fleet at `url`, like `with_client`."""
    from orchestrator.jobs.client import JobsClient

    return with_connected(url, JobsClient.connect, fn)


def _since(start: float | None, end: float | None) -> str:
    if start is None or end is None:
        return "-"
    return f"{(end - start) * 1000:.0f}ms" if end - start < 10 else f"{end - start:.1f}s"


def _jobs_table(jobs: list[Job]) -> None:
    table = FitTable(header_style="bold", box=box.SIMPLE_HEAD, cut_first=("reason", "waited", "ran", "exit"))
    for column in ("id", "state", "attempt", "worker", "exit", "waited", "ran", "reason"):  # lower case, as every table
        table.add_column(column, no_wrap=column in KEYS, overflow="fold")
    for job in jobs:
        table.add_row(
            job.id,
            job.state,
            f"{job.attempt}/{job.max_attempts}",
            job.worker_id or "-",
            "-" if job.exit_code is None else str(job.exit_code),
            _since(job.submitted_at, job.claimed_at),
            _since(job.started_at, job.finished_at),
            job.reason,
        )
    console.print(table)


def _check_region(nats: str | None, region: str) -> None:
    """Exit 4 if the fleet's brokers list no live worker in `region`; nothing if none answers (a fleet of
    workers only runs jobs too: their queue waits for a worker of the region)."""
    from bus.contract.errors import FauxmadError
    from orchestrator.cli.names import Unknown, require_regions

    try:
        with_client(nats, lambda client: require_regions(client, [region]))
    except Unknown:
        raise
    except FauxmadError:
        return


@job_app.command("submit", context_settings={"allow_interspersed_args": False})
def submit(
    cmd: list[str] = typer.Argument(
        None, help="the command to run, after -- (default: the spec's jobs.cmd, else the image's)"
    ),
    app: str | None = typer.Option(None, "--app", "-a", help="the app [default: the spec's]", callback=check_app),
    region: str | None = typer.Option(None, "--region", "-r", help="the region to run it in", callback=check_region),
    count: int = typer.Option(1, "--count", "-n", min=1, max=10_000, help="how many jobs to submit at once"),
    cpus: int | None = typer.Option(None, "--cpus", min=1, help="cpus for each attempt [default: 1]"),
    memory_mb: int | None = typer.Option(None, "--memory-mb", min=1, help="memory for each attempt [default: 256]"),
    timeout: str | None = typer.Option(None, "--timeout", help="an attempt running longer is killed: 30s, 10m [1h]"),
    max_attempts: int | None = typer.Option(None, "--max-attempts", min=1, max=100, help="then dead-lettered [3]"),
    idempotency_key: str | None = typer.Option(None, "--idempotency-key", help="the same key: the same jobs, once"),
    runner: str | None = typer.Option(
        None, "--runner", help="machine (default: a machine that destroys itself) or process (the fast path)"
    ),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    image: str | None = typer.Option(
        None, "--image", help="run it in this image (name:tag or sha256:...); no CMD: the image's own"
    ),
    spec_path: Path | None = typer.Option(None, "--config", "-c", help="an app spec whose jobs table gives defaults"),
    wait: bool = typer.Option(False, "--wait", "-w", help="wait until every job has finished (exit 1 if any failed)"),
    wait_timeout: float = typer.Option(3600.0, "--wait-timeout", min=0, help="with --wait: give up after this long"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """Submit a job: `fauxmad job submit -a APP -r REGION -- CMD...`; prints each job's id.

    The region's work queue holds it until a worker with a free slot takes it (late binding); each
    attempt runs as a machine that destroys itself when done. A failed attempt is retried with back-off
    (0.5 s, doubling) up to --max-attempts, then the job is dead-lettered. With --image the job runs in
    that image, pinned to its digest when submitted (an unknown one is refused, exit 2).
    """
    from orchestrator.apps.spec import SpecError, load_spec
    from orchestrator.jobs.spec import SubmitOptions, submit_request

    if region is not None:  # as `machine run`: an unknown region is exit 4, naming the regions there are
        _check_region(nats, region)

    try:
        spec = load_spec(spec_path) if spec_path is not None else None
        options = SubmitOptions(
            app=app,
            region=region,
            cmd=list(cmd or []),
            env=key_values(env),
            count=count,
            cpus=cpus,
            memory_mb=memory_mb,
            timeout=timeout,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            runner=runner,
            image=image,
        )
        where, request = submit_request(options, spec)
    except (SpecError, ValueError) as exc:
        fail(str(exc), EXIT_USAGE)

    async def go(client: JobsClient) -> list[Job]:
        jobs = await client.submit(where, request)
        if wait:
            done = await client.wait(request.app, [job.id for job in jobs], wait_timeout, submitted=True)
            jobs = [done[job.id] for job in jobs]
        return jobs

    jobs = _client(nats, go)
    if json_out:
        print_json(jobs)
    elif wait:
        _jobs_table(jobs)
    else:
        for job in jobs:
            sys.stdout.write(f"{job.id}\n")
    if wait and any(job.state != "succeeded" for job in jobs):
        raise typer.Exit(EXIT_FAILED)


@job_app.command("status")
def status(
    job_id: str = JobIdArgument,
    app: str = AppOption,
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """A job's state, attempts (worker, machine, exit) and why."""
    job = _client(nats, lambda client: client.status(app, job_id))
    if json_out:
        print_json(job)
        return
    _jobs_table([job])
    for attempt in job.attempts:
        where = f"{attempt.worker_id}" + (f" machine {attempt.machine_id}" if attempt.machine_id else "")
        exit_text = "" if attempt.exit_code is None else f" exit {attempt.exit_code}"
        console.print(f"  attempt {attempt.attempt}: {attempt.outcome} on {where}{exit_text}", highlight=False)


@job_app.command("list")
def list_jobs(
    app: str = AppOption,
    state: str | None = typer.Option(None, "--state", help="queued, running, succeeded, failed or cancelled"),
    region: str | None = typer.Option(None, "--region", "-r", help="only this region's", callback=check_region),
    limit: int = typer.Option(100, "--limit", "-n", min=1, max=100_000, help="at most this many, newest first"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """An app's jobs, newest first."""
    if state is not None and state not in ("queued", "running", "succeeded", "failed", "cancelled"):
        fail(f"invalid --state {state!r}: use queued, running, succeeded, failed or cancelled", EXIT_USAGE)
    jobs = _client(nats, lambda client: client.list(app, state=state, region=region, limit=limit))
    if json_out:
        print_json(jobs)
    elif not jobs:
        typer.echo(f"no jobs of app {app}", err=True)
    else:
        _jobs_table(jobs)


@job_app.command("cancel")
def cancel(
    job_id: str = JobIdArgument,
    app: str = AppOption,
    timeout: float = typer.Option(10.0, "--wait-timeout", min=0, help="wait this long for a running job to end"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
) -> None:
    """Cancel a job: a queued one at once; a running one is killed on its worker, and waited for."""

    async def go(client: JobsClient) -> Job:
        job = await client.cancel(app, job_id)
        if job.state in ("queued", "running"):
            job = (await client.wait(app, [job_id], timeout))[job_id]
        return job

    job = _client(nats, go)
    if json_out:
        print_json(job)
    else:
        console.print(f"{job.id} {job.state}", highlight=False)
    if job.state != "cancelled":
        raise typer.Exit(EXIT_FAILED)


@job_app.command("logs")
def logs(
    job_id: str = JobIdArgument, app: str = AppOption, nats: str | None = NatsOption, json_out: bool = JsonOption
) -> None:
    """What the job's last attempt wrote: stdout, then stderr (the last 4 KiB of each), verbatim."""
    job = _client(nats, lambda client: client.status(app, job_id))
    if json_out:
        print_json({"id": job.id, "attempt": job.attempt, "stdout": job.stdout, "stderr": job.stderr})
        return
    sys.stdout.write(job.stdout)
    sys.stderr.write(job.stderr)
    if not job.stdout and not job.stderr:
        typer.echo(f"job {job.id} wrote nothing (state {job.state})", err=True)


@job_app.command("wait")
def wait_jobs(
    job_ids: list[str] = typer.Argument(..., help="job ids"),
    app: str = AppOption,
    timeout: float = typer.Option(3600.0, "--timeout", min=0, help="give up after this long (exit 1)"),
    nats: str | None = NatsOption,
    json_out: bool = JsonOption,
    wide: bool = WideOption,
) -> None:
    """Wait until every job has finished; exit 0 if all succeeded, else 1. An id the app has no job of is
    exit 4 at once (not a wait of --timeout)."""
    started = time.monotonic()
    done = _client(nats, lambda client: client.wait(app, job_ids, timeout))
    jobs = [done[job_id] for job_id in job_ids]
    if json_out:
        print_json(jobs)
    else:
        _jobs_table(jobs)
        typer.echo(f"waited {time.monotonic() - started:.1f}s", err=True)
    if any(job.state != "succeeded" for job in jobs):
        raise typer.Exit(EXIT_FAILED)
