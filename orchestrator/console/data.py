"""What each page shows, gathered from where the CLI reads it: the view, the brokers, releases, jobs, logs, and
the edge proxies' `/metrics` (their numbers are nowhere else). Plain records out, nothing rendered here."""

from __future__ import annotations

import asyncio
import time
import urllib.request
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from bus.contract import subjects
from bus.contract.codec import decode
from bus.contract.errors import Forbidden, Unreachable
from bus.contract.jobs import Job
from bus.contract.machines import GetRequest, Machine, MachineEvent
from bus.stores.job_queue import JobQueue
from bus.stores.kv_watch import current_values
from bus.transport.jsfast import FastJetStream
from bus.transport.nats_adapter import BucketNotFoundError, Nats, NotFoundError
from orchestrator.api.http import Brokers
from orchestrator.apps.releases import Head, Release, Releases
from orchestrator.apps.store import KVReleaseStore
from orchestrator.jobs.client import JobsClient
from orchestrator.logs import LogQuery, LogRecord, read_logs
from orchestrator.view.model import MachineRow

LOG_LINES = 40
JOBS_SHOWN = 200
QUEUED_READ = 1000  # queued jobs read for the jobs page, oldest first (one message read each)


class Progress(msgspec.Struct, frozen=True):
    """One region of a release: machines it wants, machines of it started, machines of older releases left."""

    region: str
    wanted: int
    started: int
    of_release: int
    older: int


class Edge(msgspec.Struct, frozen=True):
    requests: int = 0
    errors: int = 0  # 5xx answers
    autostarts: int = 0  # machines started or created for a request
    resumes: int = 0
    proxies: int = 0  # proxies that answered
    unanswered: list[str] = []


class AppData(msgspec.Struct, frozen=True):
    name: str
    head: Head | None
    releases: list[Release]
    progress: list[Progress]
    machines: list[MachineRow]
    edge: Edge | None


async def machine(brokers: Brokers, app: str, machine_id: str) -> Machine:
    """The machine with its events, as the brokers answer it (`NotFound`: no such machine in `app`)."""
    subject = subjects.api_machines(app, "get")
    return await brokers.call(subject, GetRequest(id=machine_id, events=True), Machine, timeout=10)


def kept_explain(found: Machine) -> dict[str, Any] | None:
    events: Sequence[MachineEvent] = found.events if isinstance(found.events, list) else []
    return next((event.placement for event in events if event.placement), None)


async def releases(nc: Nats, app: str) -> tuple[Head | None, list[Release], bool]:
    """The app's head and releases, and whether it has a record (`POST /v1/apps` made it)."""
    try:
        store = KVReleaseStore(await nc.jetstream().key_value(subjects.APPS_BUCKET))
    except (BucketNotFoundError, NotFoundError):
        return None, [], False
    found = Releases(store)
    recorded = await store.get(f"{app}.record") is not None
    return await found.head(app), await found.list(app), recorded


def progress(release: Release | None, machines: list[MachineRow]) -> list[Progress]:
    """Where the newest release stands in each region its spec names (and each region with its machines)."""
    if release is None:
        return []
    version = str(release.version)
    regions = sorted(set(release.spec.regions) | {m.region for m in machines})
    out = []
    for region in regions:
        here = [m for m in machines if m.region == region and m.state != "destroyed"]
        mine = [m for m in here if m.release == version]
        out.append(
            Progress(
                region=region,
                wanted=release.spec.regions.get(region, 0),
                started=sum(m.state == "started" for m in mine),
                of_release=len(mine),
                older=len(here) - len(mine),
            )
        )
    return out


def _scrape(url: str, app: str) -> Edge:
    with urllib.request.urlopen(url, timeout=2) as reply:  # an operator's own proxy admin URL
        return edge_numbers(reply.read().decode(), app)


def edge_numbers(text: str, app: str) -> Edge:
    """`app`'s numbers in one proxy's Prometheus exposition (`orchestrator.proxy.metrics`)."""
    requests = errors = autostarts = resumes = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("app") != app or sample.name.endswith("_created"):
                continue
            if sample.name == "fauxmad_proxy_requests_total":
                requests += int(sample.value)
                errors += int(sample.value) if sample.labels.get("status", "").startswith("5") else 0
            elif sample.name == "fauxmad_proxy_machines_woken_total":
                if sample.labels.get("kind") == "resume":
                    resumes += int(sample.value)
                else:
                    autostarts += int(sample.value)
    return Edge(requests=requests, errors=errors, autostarts=autostarts, resumes=resumes, proxies=1)


async def edge(urls: Sequence[str], app: str) -> Edge | None:
    """The app's numbers summed over the edge proxies whose `/metrics` the API was told (`--proxy-metrics`)."""
    if not urls:
        return None
    total = Edge()
    for url, got in zip(urls, await asyncio.gather(*(asyncio.to_thread(_scrape, u, app) for u in urls),
                                                   return_exceptions=True), strict=True):  # fmt: skip
        if isinstance(got, BaseException):
            total = msgspec.structs.replace(total, unanswered=[*total.unanswered, url])
            continue
        total = Edge(
            requests=total.requests + got.requests,
            errors=total.errors + got.errors,
            autostarts=total.autostarts + got.autostarts,
            resumes=total.resumes + got.resumes,
            proxies=total.proxies + 1,
            unanswered=total.unanswered,
        )
    return total


async def logs(nc: Nats, app: str, machine_id: str | None = None, lines: int = LOG_LINES) -> list[LogRecord]:
    out: list[LogRecord] = []
    await read_logs(nc, LogQuery(app=app, machine_id=machine_id, lines=lines), out.extend)
    return out


_queues: weakref.WeakKeyDictionary[Any, JobQueue] = weakref.WeakKeyDictionary()


async def _queue(nc: Nats) -> JobQueue:
    """The work queues' reader of this connection (one reply inbox for the process, not one per page)."""
    queue = _queues.get(nc)
    if queue is None:
        queue = _queues[nc] = JobQueue(await FastJetStream(nc).start())
    return queue


async def jobs(nc: Nats, app: str | None) -> list[Job]:
    """Every job (of `app`, or all), newest first, at most `JOBS_SHOWN`: the records, and the queued jobs that
    have none yet (issue 44: a worker writes a job's record when it takes it), read from the work queues
    first (a job taken between the two reads has its record written before its message goes)."""
    found: dict[tuple[str, str], Job] = {}
    try:
        queued = await (await _queue(nc)).queued(app, most=QUEUED_READ)
    except (Forbidden, Unreachable):
        queued = []  # the queues out of reach: the records alone, as before
    for job in queued:
        found[(job.app, job.id)] = job
    try:
        kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    except (BucketNotFoundError, NotFoundError):
        kv = None
    if kv is not None:
        for entry in await current_values(kv, f"{subjects.check_token('app', app)}.*" if app else ">", timeout=10.0):
            if entry.value:
                try:
                    job = decode(Job, entry.value)
                except Exception:
                    continue
                found[(job.app, job.id)] = job
    shown = sorted(found.values(), key=lambda j: j.submitted_at, reverse=True)
    return shown[:JOBS_SHOWN]


async def job(nc: Nats, app: str, job_id: str) -> Job:
    return await JobsClient(nc).status(app, job_id)


def ago(epoch_seconds: float | None, now: float | None = None) -> str:
    if not epoch_seconds:
        return "-"
    delta = (now or time.time()) - epoch_seconds
    if delta < 90:
        return f"{delta:.0f} s ago"
    if delta < 5400:
        return f"{delta / 60:.0f} min ago"
    return f"{delta / 3600:.1f} h ago"
