"""Every NATS subject, bucket and stream name fauxmad uses, built in one place.

The subjects are a public contract (`fauxmad.v1...`): other services speak them. Keeping every
name here means a version bump or a rename is one edit, and no module string-builds a subject of
its own. Tokens that come from users (app names, regions, ids) are checked, because a `.`, `*` or
`>` inside one would silently address a different subject.
"""

from __future__ import annotations

import re

from bus.contract.base import TOKEN_PATTERN
from bus.contract.codec import clip
from bus.contract.errors import BadRequest
from bus.contract.verbs import API_REQUESTS, API_VOLUME_REQUESTS, WORKER_REQUESTS, WORKER_VOLUME_REQUESTS

PREFIX = "fauxmad.v1"

WORKERS_BUCKET = "fauxmad_workers"
MACHINES_BUCKET = "fauxmad_machines"
APPS_BUCKET = "fauxmad_apps"
IDEMPOTENCY_BUCKET = "fauxmad_idempotency"
IMAGES_STORE = "fauxmad_images"
IMAGE_TAGS_BUCKET = "fauxmad_image_tags"  # image manifests and tags
REVOKED_TOKENS_BUCKET = "fauxmad_revoked_tokens"  # ids of revoked HTTP API tokens (value: when and why)
AUDIT_STREAM = "FAUXMAD_AUDIT"
# routing index: volume id -> worker, app, region, state (docs/tutorials/images-and-volumes.md)
VOLUMES_BUCKET = "fauxmad_volumes"
SNAPSHOTS_STORE = "fauxmad_volume_snapshots"  # volume snapshots: objects named by snapshot id
EVENTS_STREAM = "FAUXMAD_EVENTS"
LOGS_STREAM = "FAUXMAD_LOGS"

BROKER_QUEUE = "brokers"
BROKER_SERVICE = "fauxmad-broker"
WORKER_SERVICE = "fauxmad-worker"

WORKER_VERBS = tuple(WORKER_REQUESTS)
API_VERBS = tuple(API_REQUESTS)
WORKER_VOLUME_VERBS = tuple(WORKER_VOLUME_REQUESTS)
API_VOLUME_VERBS = tuple(API_VOLUME_REQUESTS)

TOKEN = re.compile(TOKEN_PATTERN)  # one subject token a user may name


def check_token(kind: str, value: str) -> str:
    """Return `value` if it can stand as one subject token, else raise a 400 naming `kind`.

    The one check of user-given names (apps, regions, machine and worker ids), wherever they enter:
    the CLI's options, the broker's subjects, the worker's config. The message shows the value clipped.
    """
    if not isinstance(value, str) or not TOKEN.fullmatch(value):
        raise BadRequest(f"invalid {kind} {clip(repr(value))}: use 1-64 letters, digits, '-' or '_'")
    return value


def offers(region: str) -> str:
    return f"{PREFIX}.offers.{check_token('region', region)}"


def worker_prefix(worker_id: str) -> str:
    return f"{PREFIX}.worker.{check_token('worker id', worker_id)}"


def worker_machines(worker_id: str, verb: str) -> str:
    return f"{worker_prefix(worker_id)}.machines.{verb}"


def worker_machines_wildcard(worker_id: str) -> str:
    return f"{worker_prefix(worker_id)}.machines.*"


def worker_offer(worker_id: str) -> str:
    """One worker's own offer subject (an addition to the contract): lets p2c ask just two workers."""
    return f"{worker_prefix(worker_id)}.offer"


def worker_info(worker_id: str) -> str:
    return f"{worker_prefix(worker_id)}.info"


def worker_cordon(worker_id: str, cordon: bool) -> str:
    return f"{worker_prefix(worker_id)}.{'cordon' if cordon else 'uncordon'}"


def worker_volumes(worker_id: str, verb: str) -> str:
    """A worker's volume verbs (docs/tutorials/images-and-volumes.md): `create`, `list`, `get`, `extend`, `destroy`,
    `snapshot`."""
    return f"{worker_prefix(worker_id)}.volumes.{verb}"


def worker_volumes_wildcard(worker_id: str) -> str:
    return f"{worker_prefix(worker_id)}.volumes.*"


def api_volumes(app: str, verb: str) -> str:
    """The brokers' volume verbs for an app (queue group `brokers`)."""
    return f"{PREFIX}.api.apps.{check_token('app', app)}.volumes.{verb}"


API_VOLUMES_WILDCARD = f"{PREFIX}.api.apps.*.volumes.*"


def api_machines(app: str, verb: str) -> str:
    return f"{PREFIX}.api.apps.{check_token('app', app)}.machines.{verb}"


API_MACHINES_WILDCARD = f"{PREFIX}.api.apps.*.machines.*"


def api_machines_create_in(app: str, region: str) -> str:
    """`fauxmad.v1.api.apps.<app>.machines.create.<region>` (an addition): a create answered by `<region>`'s
    brokers, so in a supercluster the auction runs inside the region and only the request and reply cross."""
    return f"{api_machines(app, 'create')}.{check_token('region', region)}"


def api_machines_create_in_wildcard(region: str | None) -> str:
    """What a broker of `region` answers (every region's, `*`, for a broker of no region: one server)."""
    return f"{PREFIX}.api.apps.*.machines.create.{check_token('region', region) if region else '*'}"


def api_edge(app: str, verb: str) -> str:
    """The edge proxy's machine verbs for an app (queue group `brokers`): the machines verbs a proxy needs, which
    brokers answer only for an app whose release has an `[http_service]` (docs/how-to/secure-fleet.md: the proxy
    role)."""
    return f"{PREFIX}.api.apps.{check_token('app', app)}.edge.{verb}"


API_EDGE_WILDCARD = f"{PREFIX}.api.apps.*.edge.*"


def api_images_push(app: str) -> str:
    """The brokers' checked image push for an app (docs/how-to/secure-fleet.md: who may do what with images)."""
    return f"{PREFIX}.api.apps.{check_token('app', app)}.images.push"


API_IMAGES_PUSH_WILDCARD = f"{PREFIX}.api.apps.*.images.push"


def api_images_rm(app: str) -> str:
    """The brokers' checked removal of one of an app's images (a deployer's `image rm`)."""
    return f"{PREFIX}.api.apps.{check_token('app', app)}.images.rm"


API_IMAGES_RM_WILDCARD = f"{PREFIX}.api.apps.*.images.rm"


def api_images_upload(app: str, broker: str, upload: str) -> str:
    """Where an upload's chunks go: `...images.upload.<broker>.<upload>`, heard by the broker that opened it."""
    tokens = (check_token("app", app), check_token("broker", broker), check_token("upload", upload))
    return "{}.api.apps.{}.images.upload.{}.{}".format(PREFIX, *tokens)


def api_images_uploads_of(broker: str) -> str:
    """Every upload one broker holds, of any app."""
    return f"{PREFIX}.api.apps.*.images.upload.{check_token('broker', broker)}.*"


API_REGIONS_LIST = f"{PREFIX}.api.regions.list"
API_WORKERS_LIST = f"{PREFIX}.api.workers.list"
API_PLACEMENTS_SIMULATE = f"{PREFIX}.api.placements.simulate"


def events(region: str, worker_id: str, app: str, machine_id: str) -> str:
    return f"{PREFIX}.events.{region}.{worker_id}.{app}.{machine_id}"


EVENTS_ALL = f"{PREFIX}.events.>"


def _app_machine_tokens(app: str | None, machine_id: str | None) -> str:
    """`<app>.<machine>` for a stream filter: each checked when given, `*` when not."""
    app_token = check_token("app", app) if app else "*"
    machine_token = check_token("machine id", machine_id) if machine_id else "*"
    return f"{app_token}.{machine_token}"


def events_filter(app: str | None = None, machine_id: str | None = None) -> str:
    """The events of one app, one machine, or both (any region, any worker): a stream filter subject."""
    return f"{PREFIX}.events.*.*.{_app_machine_tokens(app, machine_id)}"


def logs(app: str, machine_id: str) -> str:
    return f"{PREFIX}.logs.{app}.{machine_id}"


LOGS_ALL = f"{PREFIX}.logs.>"


def logs_filter(app: str | None = None, machine_id: str | None = None) -> str:
    """The log lines of one app, one machine, or both: a stream filter subject."""
    return f"{PREFIX}.logs.{_app_machine_tokens(app, machine_id)}"


def proxy_unreachable(app: str, machine_id: str) -> str:
    """Where an edge proxy says a machine refused or dropped a connection (docs/tutorials/edge.md)."""
    return f"{PREFIX}.proxy.unreachable.{check_token('app', app)}.{check_token('machine', machine_id)}"


PROXY_UNREACHABLE_ALL = f"{PREFIX}.proxy.unreachable.>"


def proxy_activity(app: str) -> str:
    """Where each edge proxy says which of an app's machines it served lately (docs/tutorials/edge.md)."""
    return f"{PREFIX}.proxy.activity.{check_token('app', app)}"


PROXY_ACTIVITY_ALL = f"{PREFIX}.proxy.activity.*"


def audit(app: str | None) -> str:
    """`fauxmad.v1.audit.<app>` (`_fleet` for requests outside an app): one record per mutating request."""
    return f"{PREFIX}.audit.{check_token('app', app) if app else '_fleet'}"


AUDIT_ALL = f"{PREFIX}.audit.>"


def kv_put(bucket: str, key: str) -> str:
    """The subject a put (or, with header `KV-Operation: DEL`, a delete) of `key` in a KV bucket goes to."""
    return f"$KV.{bucket}.{key}"


def worker_key(region: str, worker_id: str) -> str:
    """Key of a worker's heartbeat in the `fauxmad_workers` bucket."""
    return f"{region}.{worker_id}"


GROUP_KEY_SUFFIX = "group"


def group_key(region: str, first_worker_id: str) -> str:
    """Key of a beat group in the `fauxmad_workers` bucket: the heartbeats of logical workers that share a process
    (`fauxmad worker --count`), in one value named after its first worker (`bus.contract.fleet.BeatGroups`). Three
    tokens where a worker's key has two: a region and a worker id are one token each."""
    return f"{region}.{first_worker_id}.{GROUP_KEY_SUFFIX}"


def is_group_key(key: str) -> bool:
    return key.count(".") == 2 and key.endswith(f".{GROUP_KEY_SUFFIX}")


# ---------------------------------------------------------------------------------------------------
# Background jobs (addition, docs/how-to/jobs.md)

JOBS_BUCKET = "fauxmad_jobs"  # key `<app>.<job id>`: the job's record
JOBS_DEAD_STREAM = "FAUXMAD_JOBS_DEAD"
JOB_EVENTS_STREAM = "FAUXMAD_JOB_EVENTS"
JOBS_QUEUE = "jobs"  # the queue group of the job subjects
JOBS_CONSUMER = "workers"  # the one durable pull consumer of each region's work queue
JOB_VERBS = ("status", "list", "cancel")  # `fauxmad.v1.api.apps.<app>.jobs.<verb>`, besides `submit.<region>`
JOBS_DEAD_ALL = f"{PREFIX}.jobs.dead.>"
JOB_EVENTS_ALL = f"{PREFIX}.jobs.events.>"


def api_jobs(app: str, verb: str) -> str:
    """`fauxmad.v1.api.apps.<app>.jobs.<verb>`: status, list, cancel (any worker answers)."""
    return f"{PREFIX}.api.apps.{check_token('app', app)}.jobs.{verb}"


def api_jobs_wildcard(verb: str) -> str:
    return f"{PREFIX}.api.apps.*.jobs.{verb}"


def api_jobs_submit(app: str, region: str) -> str:
    """`fauxmad.v1.api.apps.<app>.jobs.submit.<region>`: answered by that region's workers."""
    return f"{api_jobs(app, 'submit')}.{check_token('region', region)}"


def api_jobs_submit_wildcard(region: str) -> str:
    return f"{api_jobs_wildcard('submit')}.{check_token('region', region)}"


def jobs_queue(region: str) -> str:
    """The subject of region `region`'s work queue (what its stream keeps)."""
    return f"{PREFIX}.jobs.queue.{check_token('region', region)}"


def jobs_queue_job(region: str, app: str, job_id: str) -> str:
    """`fauxmad.v1.jobs.queue.<region>.<app>.<job id>` (an addition): where a submit puts each job, in the same
    stream as `jobs_queue` (the stream keeps both), so a queued job is found by its subject (`last_by_subj`)
    while no record of it exists: the record is written when a worker takes it."""
    return f"{jobs_queue(region)}.{check_token('app', app)}.{job_id}"


def jobs_queue_jobs(region: str) -> str:
    """The filter of every per-job subject of region `region`'s queue (`jobs_queue_job`)."""
    return f"{jobs_queue(region)}.>"


def jobs_queue_app(region: str, app: str) -> str:
    """The filter of app `app`'s queued jobs in region `region` (`jobs_queue_job`)."""
    return f"{jobs_queue(region)}.{check_token('app', app)}.*"


JOBS_QUEUES_ALL = f"{PREFIX}.jobs.queue.>"  # every region's work queue: its streams are found by this filter
JOBS_STREAM_PREFIX = "FAUXMAD_JOBS_"


def jobs_stream(region: str) -> str:
    """The work-queue stream of a region: `FAUXMAD_JOBS_<region>`."""
    return f"{JOBS_STREAM_PREFIX}{check_token('region', region)}"


def jobs_dead(region: str, app: str) -> str:
    return f"{PREFIX}.jobs.dead.{check_token('region', region)}.{check_token('app', app)}"


def job_events(region: str, app: str, job_id: str) -> str:
    return f"{PREFIX}.jobs.events.{region}.{app}.{job_id}"


def job_events_filter(app: str | None = None) -> str:
    return f"{PREFIX}.jobs.events.*.{check_token('app', app) if app else '*'}.*"


def worker_job_cancel(worker_id: str) -> str:
    """Where a cancel reaches the worker running the job."""
    return f"{worker_prefix(worker_id)}.jobs.cancel"


def job_key(app: str, job_id: str) -> str:
    return f"{app}.{job_id}"


def parse_verb(subject: str) -> str:
    """The last token of a request subject: the verb the caller asked for."""
    return subject.rsplit(".", 1)[-1]


def parse_api_app(subject: str) -> str:
    """The `<app>` token of `fauxmad.v1.api.apps.<app>.machines.<verb>` (or `.volumes.<verb>`, `.jobs.<verb>`,
    `.jobs.submit.<region>`); empty for a subject of no app."""
    parts = subject.split(".")
    return parts[4] if len(parts) >= 7 and parts[3] == "apps" else ""


# -- supercluster additions (docs/how-to/supercluster.md) ---------------------------------------


def regional(name: str, region: str) -> str:
    """A region's own bucket or stream in a supercluster: the contract's name with `_<region>` appended."""
    return f"{name}_{check_token('region', region)}"


def events_of_region(region: str) -> str:
    """Every event of one region (what that region's events stream captures)."""
    return f"{PREFIX}.events.{check_token('region', region)}.>"


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching of a concrete `subject` against `pattern`: `*` is one token, a final `>` the rest."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)
