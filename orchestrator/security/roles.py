"""Who may publish and subscribe to what: one role per kind of identity, enforced by nats-server.

fauxmad code alone cannot keep a stolen credential in its lane: anything connected to NATS can publish
anything the server lets it. So every identity gets server-side permissions (allow lists: whatever is
not listed is refused, and the server drops the message), built here from the contract's subjects:

- `worker` (one per host, bound to its id and region): answers only its own `worker.<id>.>` subjects and
  its own region's offers; publishes events only under `events.<region>.<id>.>` and writes only its own
  heartbeat key; records the job requests it answers in the audit stream; reads the streams it republishes
  into, and a queued job by its subject in any region's work queue (its desk answers any job's status).
- `broker`: answers the API (`api.>`); asks workers (`offers.*`, `worker.*.>`); keeps idempotency claims;
  records the requests it answers in the audit stream; reads the fleet's buckets and streams; writes the
  images a checked push brings (the image store, its manifests and tags). It hears the workers' heartbeats as
  they are published (`$KV.<workers bucket>.>`) until its registry's watch runs (orchestrator/broker/readiness.py).
- `api` (`fauxmad api`, its web console included): what a broker may (it embeds one), and what the HTTP API does
  beside it: app records, heads and their purge in the apps bucket (`POST`/`DELETE /v1/apps`), binding the audit
  stream, watching the revoked tokens, asking workers for a job's status and list (the console's job pages), and
  reading the queued jobs in every region's work queue (the console's jobs list).
  Each HTTP request's token decides which app it may touch; the server's permissions cannot.
- `proxy` (`fauxmad proxy`, the edge): only what the edge does. It reads the route table's buckets (heartbeats,
  the routing index, apps and releases) and binds the fleet's other streams (their info only); it asks the brokers'
  edge verbs (`api.apps.*.edge.{create,start,stop,suspend,resume}`: autostart, autostop, scale from zero) and
  publishes and follows the edge's signals (`proxy.activity.*`: shared idleness; `proxy.unreachable.>`: a machine
  it could not reach, for the operator's failover). Which apps: nats-server cannot tell an app with an
  `[http_service]` from one without, so the brokers answer an edge verb only for an app whose current release has
  one (orchestrator/broker/service.py); the machines verbs themselves (`api.apps.*.machines.*`, `destroy`, `exec`,
  ...) and the workers' subjects are not the proxy's, so it cannot go around that check.
- `operator`: everything, JetStream administration included.
- `deployer` (bound to one app): that app's API subjects and its releases, the fleet-wide read-only
  queries, reading events and logs. Images: reading only; it pushes and tags through the brokers' checked
  push (`api.apps.<app>.images.push`), as no permission can check that bytes hash to their name.
- `viewer`: the read-only API verbs of every app and the fleet queries; reading streams and buckets.

Replies: an identity that answers requests (`worker`, `broker`) may publish to the reply subject of a
request it received (`allow_responses`), and nothing else on inboxes. Every identity has its own inbox
prefix (`_INBOX.<name>`) and may subscribe only below it, so no one reads another's replies.

In a supercluster (`$FAUXMAD_SUPERCLUSTER` set where the users file is rendered) each region's own buckets and
events stream (`bus.transport.layout`) are added beside the fleet's: a worker writes its heartbeat and index entries
into its own region's buckets, a broker keeps claims in every region's idempotency bucket, and everyone who
reads the fleet's streams reads the regions' too.

Known limits (docs/how-to/secure-fleet.md): the routing index is keyed by machine id and the log
subjects carry no worker id, so a worker's writes there cannot be narrowed to its own machines by subject.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

from bus.contract import subjects
from bus.contract.verbs import EDGE_REQUESTS
from bus.stores.secrets import PUBLIC_KEY, SECRETS_BUCKET
from bus.transport.layout import Layout, from_env

Role = Literal["worker", "broker", "api", "proxy", "operator", "deployer", "viewer"]
ROLES: tuple[Role, ...] = ("worker", "broker", "api", "proxy", "operator", "deployer", "viewer")

P = subjects.PREFIX
FLEET_STREAMS = (
    "KV_fauxmad_layout",  # the fleet's layout (`bus.transport.fleet_layout`): every process reads it at start
    subjects.EVENTS_STREAM,
    subjects.LOGS_STREAM,
    *(f"KV_{bucket}" for bucket in (subjects.WORKERS_BUCKET, subjects.MACHINES_BUCKET, subjects.APPS_BUCKET)),
    f"KV_{subjects.IDEMPOTENCY_BUCKET}",
    f"OBJ_{subjects.IMAGES_STORE}",
    f"KV_{subjects.IMAGE_TAGS_BUCKET}",
    f"KV_{SECRETS_BUCKET}",
    f"OBJ_{subjects.SNAPSHOTS_STORE}",
    f"KV_{subjects.VOLUMES_BUCKET}",
    f"KV_{subjects.JOBS_BUCKET}",  # background jobs' records (`fauxmad job wait` watches them)
    subjects.JOB_EVENTS_STREAM,
)
READ_ONLY_VERBS = ("list", "get", "wait")
# what the edge's route table reads (orchestrator/proxy/routes.py): the layout, heartbeats, routing index, releases
ROUTE_STREAMS = (
    "KV_fauxmad_layout",
    *(f"KV_{bucket}" for bucket in (subjects.WORKERS_BUCKET, subjects.MACHINES_BUCKET, subjects.APPS_BUCKET)),
)


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """A name (its inbox prefix too), a role, and what the role is bound to."""

    name: str
    role: Role
    worker_id: str | None = None
    region: str | None = None
    app: str | None = None

    @property
    def inbox_prefix(self) -> str:
        return f"_INBOX.{self.name}"


def regional_streams(layout: Layout) -> tuple[str, ...]:
    """The streams of every region of a supercluster (none on one server)."""
    return tuple(
        name
        for region in layout.regions
        for name in (
            f"KV_{layout.workers_bucket(region)}",
            f"KV_{layout.machines_bucket(region)}",
            f"KV_{layout.idempotency_bucket(region)}",
            layout.events_stream(region),
        )
    )


def read_streams(streams: tuple[str, ...] = FLEET_STREAMS) -> tuple[str, ...]:
    """JetStream's read side for `streams` (and in a supercluster, the regions' own): info, message gets, and
    consumers (KV watches, stream reads)."""
    allowed = ["$JS.API.INFO", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST"]
    for stream in (*streams, *regional_streams(from_env())):
        allowed += [
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>",
            f"$JS.FC.{stream}.>",
        ]
    return tuple(allowed)


def queue_reads(regions: Iterable[str]) -> tuple[str, ...]:
    """Reading a queued job by its subject in the work queue of each of `regions` (`$JS.API.STREAM.MSG.GET` only:
    no consumer, no ack). A job has no record until a worker takes it (issue 44), and any worker's desk answers
    a job's status, list and cancel, so a desk reads every region's queue, and so does the console (the `api`
    role); what it reads there, the job as submitted, is what every such identity reads in the job records."""
    return tuple(f"$JS.API.STREAM.MSG.GET.{subjects.jobs_stream(region)}" for region in sorted(set(regions)))


def permissions(identity: Identity, regions: Iterable[str] = ()) -> Permissions:
    """The server-side permissions of `identity` (raises ValueError when a binding it needs is missing);
    `regions`: the fleet's regions (its workers', beside a supercluster's own), whose work queues are read."""
    layout = from_env()
    every_region = {*regions, *layout.regions, *([identity.region] if identity.region else [])}
    inbox = f"{identity.inbox_prefix}.>"
    role = identity.role
    if role == "operator":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=True)
    if role == "worker":
        worker_id, region = _required(identity, "worker_id"), _required(identity, "region")
        return Permissions(
            publish=(
                f"{P}.events.{region}.{worker_id}.>",
                f"{P}.logs.>",
                subjects.kv_put(layout.workers_bucket(region), f"{region}.{worker_id}"),
                subjects.kv_put(layout.machines_bucket(region), "*"),
                subjects.kv_put(SECRETS_BUCKET, PUBLIC_KEY),
                # the fence: a worker back from an absence settles its keyed machines' claims on itself
                # (bus/contract/idempotency.py); it hosts any app's machines, so any app's claims
                subjects.kv_put(layout.idempotency_bucket(region), ">"),
                f"$O.{subjects.SNAPSHOTS_STORE}.>",  # its volumes' snapshots (docs/tutorials/images-and-volumes.md)
                subjects.AUDIT_ALL,  # the audit records of the job requests it answers (`bus.transport.audit`)
                *read_streams(),
                *_worker_jobs_publish(region),
                *queue_reads(every_region),
            ),
            subscribe=(
                f"{P}.worker.{worker_id}.>",
                f"{P}.offers.{region}",
                "$SRV.>",
                inbox,
                subjects.api_jobs_submit_wildcard(region),
                *(subjects.api_jobs_wildcard(verb) for verb in subjects.JOB_VERBS),
            ),
            allow_responses=True,
        )
    if role in ("broker", "api"):
        return Permissions(
            publish=(
                *(_api_publish() if role == "api" else ()),
                *(queue_reads(every_region) if role == "api" else ()),
                f"{P}.offers.*",
                f"{P}.worker.*.>",
                subjects.kv_put(subjects.IDEMPOTENCY_BUCKET, ">"),
                subjects.kv_put(subjects.VOLUMES_BUCKET, "*"),
                *(subjects.kv_put(layout.idempotency_bucket(r), ">") for r in layout.regions),
                subjects.AUDIT_ALL,  # the audit records of the requests it answers (`bus.transport.audit`)
                # images pushed through it, checked (orchestrator/broker/images.py): archives, manifests, tags; the
                # purge removes the chunks of an object it replaces (a damaged one)
                f"$O.{subjects.IMAGES_STORE}.>",
                subjects.kv_put(subjects.IMAGE_TAGS_BUCKET, ">"),
                f"$JS.API.STREAM.PURGE.OBJ_{subjects.IMAGES_STORE}",
                *read_streams(),
            ),
            # the API's broker places and forwards but serves no NATS subject: it only reads its replies
            subscribe=((f"{P}.api.>", "$SRV.>", inbox, *_heartbeat_subjects(layout)) if role == "broker" else (inbox,)),
            allow_responses=role == "broker",
        )
    if role == "proxy":
        return Permissions(
            publish=(
                *(f"{P}.api.apps.*.edge.{verb}" for verb in EDGE_REQUESTS),
                subjects.PROXY_ACTIVITY_ALL,
                subjects.PROXY_UNREACHABLE_ALL,
                *read_streams(ROUTE_STREAMS),
                # binding the fleet's other streams at start (`ensure_fleet_resources`) asks for their info only
                *(f"$JS.API.STREAM.INFO.{stream}" for stream in FLEET_STREAMS if stream not in ROUTE_STREAMS),
            ),
            subscribe=(subjects.PROXY_ACTIVITY_ALL, inbox),
        )
    fleet_queries = (subjects.API_REGIONS_LIST, subjects.API_WORKERS_LIST, subjects.API_PLACEMENTS_SIMULATE)
    if role == "deployer":
        app = _required(identity, "app")
        return Permissions(
            publish=(
                f"{P}.api.apps.{app}.>",
                *fleet_queries,
                subjects.kv_put(subjects.APPS_BUCKET, f"{app}.>"),
                subjects.kv_put(SECRETS_BUCKET, f"{app}.*"),
                # images: no write of the store or its manifests and tags; it pushes and tags through the brokers
                # (`api.apps.<app>.images.push`, above), which check hashes and owners (orchestrator/broker/images.py)
                *read_streams(),
            ),
            subscribe=(inbox,),
        )
    if role == "viewer":
        return Permissions(
            publish=(
                *(f"{P}.api.apps.*.machines.{verb}" for verb in READ_ONLY_VERBS),
                *(f"{P}.api.apps.*.volumes.{verb}" for verb in ("list", "get", "snapshots")),
                subjects.api_jobs_wildcard("status"),
                subjects.api_jobs_wildcard("list"),
                subjects.API_REGIONS_LIST,
                subjects.API_WORKERS_LIST,
                *read_streams(),
            ),
            subscribe=(inbox,),
        )
    raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")


def _heartbeat_subjects(layout: Layout) -> tuple[str, ...]:
    """Where the workers' heartbeats are published: the fleet's workers bucket and each region's."""
    return (
        subjects.kv_put(subjects.WORKERS_BUCKET, ">"),
        *(subjects.kv_put(layout.workers_bucket(r), ">") for r in layout.regions),
    )


def _api_publish() -> tuple[str, ...]:
    """The HTTP API's own, beside its embedded broker's: app records and heads (`orchestrator/api/apps.py`), the
    audit stream it binds at start (`orchestrator/api/run.py`), the revoked tokens it watches, and the job verbs
    the console's job pages ask (`orchestrator/console/data.py`)."""
    return (
        subjects.kv_put(subjects.APPS_BUCKET, ">"),
        f"$JS.API.STREAM.INFO.{subjects.AUDIT_STREAM}",
        subjects.api_jobs_wildcard("status"),
        subjects.api_jobs_wildcard("list"),
        *read_streams((f"KV_{subjects.REVOKED_TOKENS_BUCKET}",)),
    )


def _required(identity: Identity, field: str) -> str:
    value = getattr(identity, field)
    if not value:
        raise ValueError(f"role {identity.role} needs --{field.replace('_', '-')}")
    return str(value)


def _worker_jobs_publish(region: str) -> tuple[str, ...]:
    """Background jobs: the worker's desk fills its region's queue and keeps the records; its runner pulls
    from that queue, acks, dead-letters and publishes job events for its region; a cancel may ask the
    worker running the job."""
    return (
        subjects.jobs_queue(region),
        subjects.jobs_queue_jobs(region),  # a job's own subject in the queue (issue 44)
        f"{P}.jobs.dead.{region}.>",
        f"{P}.jobs.events.{region}.>",
        f"{P}.worker.*.jobs.cancel",
        subjects.kv_put(subjects.JOBS_BUCKET, ">"),
        *read_streams((subjects.jobs_stream(region), subjects.JOBS_DEAD_STREAM)),
    )
