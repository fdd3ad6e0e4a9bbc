"""The NATS contract, machine-readable: JSON Schema for every message, an AsyncAPI 3.0 document for every
subject, generated from the very Structs that decode the messages and the tables that list the verbs.

Nothing here is written by hand twice: the schemas come from `msgspec.json.schema_components` over
the contract's message modules, the verbs from `WORKER_REQUESTS`/`API_REQUESTS`, and the addresses from
`bus.contract.subjects`' prefix. `fauxmad schema asyncapi` prints the document; the micro services'
`$SRV.INFO` metadata names the channel of each endpoint, so a service that discovers a worker or broker
finds its schema.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import msgspec

from bus.contract import jobs as j
from bus.contract import subjects
from bus.contract.base import Ack, ErrorBody
from bus.contract.edge import ProxyActivity, ProxyUnreachable
from bus.contract.fleet import (
    CordonRequest,
    CreateRequest,
    InfoRequest,
    RegionsListRequest,
    RegionSummary,
    SimulateRequest,
    WorkerInfo,
    WorkersListRequest,
)
from bus.contract.images import ImageChunk, ImagePushReply, ImagePushRequest, ImageRemoveReply, ImageRemoveRequest
from bus.contract.machines import ExecReply, Lease, Machine, MachineEvent
from bus.contract.offers import Decline, Offer, OfferRequest
from bus.contract.streams import AuditRecord, LogLine
from bus.contract.verbs import (
    API_REQUESTS,
    API_VOLUME_REQUESTS,
    BROKER_REQUESTS,
    EDGE_REQUESTS,
    WORKER_REQUESTS,
    WORKER_VOLUME_REQUESTS,
)
from bus.contract.volumes import Volume, VolumeSnapshot

P = subjects.PREFIX
ASYNCAPI_VERSION = "3.0.0"
ERROR_HEADERS = "replies that fail carry `Nats-Service-Error-Code` and `Nats-Service-Error` headers and an ErrorBody"


class Channel(NamedTuple):
    name: str
    address: str  # with {parameters}
    summary: str
    payload: Any  # the message type sent on it
    reply: Any = None  # the reply's type for a request, None for a publish
    parameters: tuple[str, ...] = ()


def _verb_reply(verb: str) -> Any:
    return {"list": list[Machine], "exec": ExecReply, "lease": Lease}.get(verb, Machine)


def channels() -> list[Channel]:
    out = [
        Channel(
            f"worker_machines_{verb}",
            f"{P}.worker.{{worker_id}}.machines.{verb}",
            f"A worker's `{verb}` of one of its machines (the worker is the source of truth).",
            kind,
            _verb_reply(verb),
            ("worker_id",),
        )
        for verb, kind in WORKER_REQUESTS.items()
    ]
    out += [
        Channel(
            f"api_machines_{verb}",
            f"{P}.api.apps.{{app}}.machines.{verb}",
            f"The brokers' `{verb}` (queue group `brokers`): "
            + ("placed by an auction." if verb == "create" else "asked of the app's workers.")
            if verb in BROKER_REQUESTS
            else f"The brokers' `{verb}` (queue group `brokers`): forwarded to the machine's worker.",
            kind,
            _verb_reply(verb) if verb != "create" else Machine,
            ("app",),
        )
        for verb, kind in API_REQUESTS.items()
    ]
    out += [
        Channel(
            f"api_edge_{verb}",
            f"{P}.api.apps.{{app}}.edge.{verb}",
            f"The brokers' `{verb}` for an edge proxy (queue group `brokers`): as `api_machines_{verb}`, for an app "
            "whose current release has an `[http_service]` only (403 otherwise).",
            kind,
            Machine,
            ("app",),
        )
        for verb, kind in EDGE_REQUESTS.items()
    ]
    out.append(
        Channel(
            "api_machines_create_in_region",
            f"{P}.api.apps.{{app}}.machines.create.{{region}}",
            "A create answered by the brokers of the request's region (queue group `brokers`): in a supercluster "
            "the auction runs inside that region and only the request and its reply cross the WAN. The payload's "
            "`region` must be the subject's (else 400).",
            CreateRequest,
            Machine,
            ("app", "region"),
        )
    )
    out += [
        Channel("offers", f"{P}.offers.{{region}}", "An auction's call for offers (scatter).", OfferRequest,
                Offer | Decline, ("region",)),
        Channel("worker_offer", f"{P}.worker.{{worker_id}}.offer", "One worker's offer (p2c).", OfferRequest,
                Offer | Decline, ("worker_id",)),
        Channel("worker_info", f"{P}.worker.{{worker_id}}.info", "A worker's heartbeat, on request.", InfoRequest,
                WorkerInfo, ("worker_id",)),
        Channel("worker_cordon", f"{P}.worker.{{worker_id}}.cordon", "Take no new machines.", CordonRequest,
                WorkerInfo, ("worker_id",)),
        Channel("worker_uncordon", f"{P}.worker.{{worker_id}}.uncordon", "Take machines again.", CordonRequest,
                WorkerInfo, ("worker_id",)),
        Channel("regions_list", subjects.API_REGIONS_LIST, "Regions with their capacity.", RegionsListRequest,
                list[RegionSummary]),
        Channel("workers_list", subjects.API_WORKERS_LIST, "Live workers.", WorkersListRequest, list[WorkerInfo]),
        Channel("placements_simulate", subjects.API_PLACEMENTS_SIMULATE, "A dry-run auction and its explain.",
                SimulateRequest, dict[str, Any]),
        Channel("events", f"{P}.events.{{region}}.{{worker_id}}.{{app}}.{{machine_id}}",
                "Every machine state transition (stream FAUXMAD_EVENTS).", MachineEvent, None,
                ("region", "worker_id", "app", "machine_id")),
        Channel("logs", f"{P}.logs.{{app}}.{{machine_id}}", "Machines' output lines (stream FAUXMAD_LOGS).",
                LogLine, None, ("app", "machine_id")),
        Channel("proxy_unreachable", f"{P}.proxy.unreachable.{{app}}.{{machine_id}}",
                "An edge proxy could not reach a machine.", ProxyUnreachable, None, ("app", "machine_id")),
        Channel("proxy_activity", f"{P}.proxy.activity.{{app}}",
                "The machines an edge proxy served lately (shared idleness).", ProxyActivity, None, ("app",)),
        Channel("audit", f"{P}.audit.{{app}}",
                "A mutating API request, over HTTP or NATS; a create's from the worker that made its machine "
                "(stream FAUXMAD_AUDIT).", AuditRecord, None, ("app",)),
    ]  # fmt: skip
    out += job_channels()
    return out + volume_channels() + image_channels()


def image_channels() -> list[Channel]:
    """The brokers' checked image push (docs/how-to/secure-fleet.md: who may do what with images)."""
    return [
        Channel("api_images_push", f"{P}.api.apps.{{app}}.images.push",
                "Push an image of the app (queue group `brokers`): recorded at once when the store holds its "
                "digest, else an upload is opened.", ImagePushRequest, ImagePushReply, ("app",)),
        Channel("api_images_upload", f"{P}.api.apps.{{app}}.images.upload.{{broker}}.{{upload}}",
                "An upload's chunks, in order, to the broker that opened it; the last one commits (sha256 "
                "checked against the digest).", ImageChunk, ImagePushReply, ("app", "broker", "upload")),
        Channel("api_images_rm", f"{P}.api.apps.{{app}}.images.rm",
                "Remove one of the app's images (queue group `brokers`): only an image the app pushed first and "
                "no other app tags or pins in its current release.", ImageRemoveRequest, ImageRemoveReply,
                ("app",)),
    ]  # fmt: skip


def _volume_reply(verb: str) -> Any:
    return {"list": list[Volume], "snapshot": VolumeSnapshot, "snapshots": list[VolumeSnapshot]}.get(verb, Volume)


def volume_channels() -> list[Channel]:
    """The volume verbs (docs/tutorials/images-and-volumes.md): a worker's own, and the brokers' per app."""
    out = [
        Channel(
            f"worker_volumes_{verb}",
            f"{P}.worker.{{worker_id}}.volumes.{verb}",
            f"A worker's `{verb}` of one of its volumes (a volume lives on one worker).",
            kind,
            _volume_reply(verb),
            ("worker_id",),
        )
        for verb, kind in WORKER_VOLUME_REQUESTS.items()
    ]
    out += [
        Channel(
            f"api_volumes_{verb}",
            f"{P}.api.apps.{{app}}.volumes.{verb}",
            f"The brokers' volume `{verb}` (queue group `brokers`)"
            + (": forwarded to the volume's worker." if verb in WORKER_VOLUME_REQUESTS and verb != "create"
               and verb != "list" else "."),
            kind,
            _volume_reply(verb),
            ("app",),
        )
        for verb, kind in API_VOLUME_REQUESTS.items()
    ]  # fmt: skip
    return out


def job_channels() -> list[Channel]:
    """Background jobs (an addition, docs/how-to/jobs.md)."""
    return [
        Channel("jobs_submit", f"{P}.api.apps.{{app}}.jobs.submit.{{region}}",
                "Submit jobs to a region's work queue (its workers, queue group `jobs`).", j.JobSubmitRequest,
                j.JobSubmitReply, ("app", "region")),
        Channel("jobs_status", f"{P}.api.apps.{{app}}.jobs.status",
                "One job's record (any worker, queue group `jobs`).", j.JobIdRequest, j.Job, ("app",)),
        Channel("jobs_list", f"{P}.api.apps.{{app}}.jobs.list", "An app's jobs, newest first (any worker).",
                j.JobListRequest, list[j.Job], ("app",)),
        Channel("jobs_cancel", f"{P}.api.apps.{{app}}.jobs.cancel",
                "Cancel a job: queued at once, running on its worker.", j.JobIdRequest, j.Job, ("app",)),
        Channel("worker_jobs_cancel", f"{P}.worker.{{worker_id}}.jobs.cancel",
                "Kill the attempt of a job running on this worker (sent by the job desk's cancel).", j.JobIdRequest,
                Ack, ("worker_id",)),
        Channel("jobs_queue", f"{P}.jobs.queue.{{region}}",
                "A region's work queue (stream FAUXMAD_JOBS_<region>, consumer `workers`): which job to run.",
                j.JobTask, None, ("region",)),
        Channel("jobs_queue_job", f"{P}.jobs.queue.{{region}}.{{app}}.{{job_id}}",
                "A job in its region's work queue under its own subject (an addition, same stream and consumer): "
                "what a submit writes, carrying the job as submitted; read by status, list and cancel while the "
                "job has no record.", j.JobTask, None, ("region", "app", "job_id")),
        Channel("jobs_dead", f"{P}.jobs.dead.{{region}}.{{app}}",
                "A job that failed every attempt: its final record (stream FAUXMAD_JOBS_DEAD).", j.Job, None,
                ("region", "app")),
        Channel("job_events", f"{P}.jobs.events.{{region}}.{{app}}.{{job_id}}",
                "Every job state change (stream FAUXMAD_JOB_EVENTS).", j.JobEvent, None, ("region", "app", "job_id")),
    ]  # fmt: skip


def _name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or re.sub(r"\bbus\.contract\.\w+\.", "", str(kind))


def json_schemas() -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(per channel: {"payload": schema, "reply": schema}, components): JSON Schema 2020-12 refs."""
    kinds: list[Any] = []
    for channel in channels():
        kinds.append(channel.payload)
        if channel.reply is not None:
            kinds.append(channel.reply)
    kinds.append(ErrorBody)
    refs, components = msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")
    by_channel: dict[str, Any] = {}
    position = 0
    for channel in channels():
        entry = {"payload": refs[position]}
        position += 1
        if channel.reply is not None:
            entry["reply"] = refs[position]
            position += 1
        by_channel[channel.name] = entry
    return by_channel, components


def _asyncapi_schema(node: Any) -> Any:
    """msgspec writes OpenAPI's discriminator object (`{"propertyName", "mapping"}`); an AsyncAPI Schema
    Object's `discriminator` is the property's name alone (the real parser refuses the object)."""
    if isinstance(node, dict):
        return {
            key: value["propertyName"]
            if key == "discriminator" and isinstance(value, dict)
            else _asyncapi_schema(value)
            for key, value in node.items()
        }
    if isinstance(node, list | tuple):
        return type(node)(_asyncapi_schema(item) for item in node)
    return node


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the whole NATS contract."""
    schemas, components = _asyncapi_schema(json_schemas())
    doc: dict[str, Any] = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "fauxmad NATS contract",
            "version": "1",
            "description": f"Subjects under `{P}`; JSON payloads; {ERROR_HEADERS}.",
        },
        "defaultContentType": "application/json",
        "channels": {},
        "operations": {},
        "components": {"schemas": components, "messages": {}},
    }
    messages = doc["components"]["messages"]
    for channel in channels():
        payload_name = f"{channel.name}_payload"
        messages[payload_name] = {"name": payload_name, "payload": schemas[channel.name]["payload"]}
        channel_doc: dict[str, Any] = {
            "address": channel.address,
            "summary": channel.summary,
            "messages": {payload_name: {"$ref": f"#/components/messages/{payload_name}"}},
        }
        if channel.parameters:
            channel_doc["parameters"] = {p: {"description": f"the {p.replace('_', ' ')}"} for p in channel.parameters}
        operation: dict[str, Any] = {  # a client's view: it sends requests, it receives what is published
            "action": "send" if channel.reply is not None else "receive",
            "channel": {"$ref": f"#/channels/{channel.name}"},
            "summary": channel.summary,
            "messages": [{"$ref": f"#/channels/{channel.name}/messages/{payload_name}"}],
        }
        if channel.reply is not None:
            reply_name = f"{channel.name}_reply"
            messages[reply_name] = {"name": reply_name, "payload": schemas[channel.name]["reply"]}
            channel_doc["messages"][reply_name] = {"$ref": f"#/components/messages/{reply_name}"}
            operation["reply"] = {
                "address": {"location": "$message.header#/reply_to", "description": "the request's inbox"},
                "channel": {"$ref": f"#/channels/{channel.name}"},
                "messages": [{"$ref": f"#/channels/{channel.name}/messages/{reply_name}"}],
            }
        doc["channels"][channel.name] = channel_doc
        doc["operations"][channel.name] = operation
    return doc


def endpoint_metadata(*channel_names: str) -> dict[str, str]:
    """What a micro endpoint's `$SRV.INFO` says about its contract (nats.micro metadata is str -> str)."""
    return {"asyncapi": "fauxmad schema asyncapi", "channels": ",".join(channel_names)}
