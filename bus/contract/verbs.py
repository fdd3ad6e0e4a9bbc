"""The verbs of each subject family, listed once: what each verb's payload is. Subjects, the worker's
dispatch, the broker's forwarding and the fuzz tests all read these tables.
"""

from __future__ import annotations

from bus.contract.base import Request
from bus.contract.fleet import CreateRequest
from bus.contract.machines import (
    DestroyRequest,
    ExecRequest,
    GetRequest,
    LeaseRequest,
    ListRequest,
    ReleaseRequest,
    ReserveRequest,
    ResumeRequest,
    SignalRequest,
    StartRequest,
    StopRequest,
    SuspendRequest,
    UpdateRequest,
    WaitRequest,
)
from bus.contract.volumes import (
    VolumeApiCreateRequest,
    VolumeApiListRequest,
    VolumeCreateRequest,
    VolumeExtendRequest,
    VolumeIdRequest,
    VolumeListRequest,
)

# `fauxmad.v1.worker.<id>.machines.<verb>`: the worker decodes each payload with its type.
WORKER_REQUESTS: dict[str, type[Request]] = {
    "reserve": ReserveRequest,
    "start": StartRequest,
    "stop": StopRequest,
    "destroy": DestroyRequest,
    "get": GetRequest,
    "list": ListRequest,
    "wait": WaitRequest,
    "signal": SignalRequest,
    "lease": LeaseRequest,
    "release": ReleaseRequest,
    "update": UpdateRequest,
    "exec": ExecRequest,
    "suspend": SuspendRequest,
    "resume": ResumeRequest,
}


# `fauxmad.v1.api.apps.<app>.machines.<verb>`: `create` and `list` are the broker's own; every other verb is
# forwarded to the machine's worker, which takes the same payload (a reserve is the broker's to send).
BROKER_REQUESTS: dict[str, type[Request]] = {"create": CreateRequest, "list": ListRequest}


API_REQUESTS: dict[str, type[Request]] = BROKER_REQUESTS | {
    verb: kind for verb, kind in WORKER_REQUESTS.items() if verb not in BROKER_REQUESTS and verb != "reserve"
}


# `fauxmad.v1.api.apps.<app>.edge.<verb>`: what an edge proxy asks (autostart, autostop, scale from zero), the
# same payloads as the machines verbs of that name; brokers answer them only for an app with an `[http_service]`
EDGE_REQUESTS: dict[str, type[Request]] = {
    verb: API_REQUESTS[verb] for verb in ("create", "start", "stop", "suspend", "resume")
}


# payloads that may be empty (`{}` assumed)
EMPTY_OK: frozenset[type[Request]] = frozenset({ListRequest})


# `fauxmad.v1.worker.<id>.volumes.<verb>`
WORKER_VOLUME_REQUESTS: dict[str, type[Request]] = {
    "create": VolumeCreateRequest,
    "list": VolumeListRequest,
    "get": VolumeIdRequest,
    "extend": VolumeExtendRequest,
    "destroy": VolumeIdRequest,
    "snapshot": VolumeIdRequest,
}


# `fauxmad.v1.api.apps.<app>.volumes.<verb>`: `create`, `list` and `snapshots` (a volume's snapshots, from the
# object store) are the brokers' own; the others are forwarded to the volume's worker with the same payload
API_VOLUME_REQUESTS: dict[str, type[Request]] = {
    "create": VolumeApiCreateRequest,
    "list": VolumeApiListRequest,
    "snapshots": VolumeIdRequest,
    "get": VolumeIdRequest,
    "extend": VolumeExtendRequest,
    "destroy": VolumeIdRequest,
    "snapshot": VolumeIdRequest,
}


VOLUME_EMPTY_OK: frozenset[type[Request]] = frozenset({VolumeListRequest, VolumeApiListRequest})
