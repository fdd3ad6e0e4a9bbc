"""Records of the fleet's streams that are not machine events: machines' output lines (`FAUXMAD_LOGS`) and
the audit trail of mutating requests (`FAUXMAD_AUDIT`).
"""

from __future__ import annotations

from typing import Literal

from bus.contract.base import Reply


class UploadOutcome(Reply):
    """How an image upload through the brokers ended (`orchestrator/broker/images.py`): `accepted` (the bytes hash
    to the digest and are stored, the manifest and tags recorded), `refused` (the caller's fault: other bytes than
    the digest, more or fewer than the manifest says, a chunk out of order, another app's defaults: nothing stored)
    or `failed` (the fleet's: the store could not take it, the upload sat idle, the broker stopped)."""

    outcome: Literal["accepted", "refused", "failed"]
    digest: str  # the digest the push named
    size: int  # bytes received (an accepted upload's whole archive)
    reason: str = ""  # why, for refused and failed (the error the last chunk got)


class AuditRecord(Reply):
    """Stream `FAUXMAD_AUDIT`, subject `fauxmad.v1.audit.<app>`: one mutating API request, over HTTP (`method`
    is the HTTP method, `path` the URL path) or over NATS (`method` "NATS", `path` the subject)."""

    at: float
    # HTTP: "token:<id>" (caveats in `scope`), "static-token", "anonymous" (open API), "refused";
    # NATS: "nkey:<public key>" (a signed request, `bus.transport.audit`), "unsigned"
    identity: str
    method: str
    path: str
    status: int
    scope: list[str] = []
    app: str = ""
    remote: str = ""
    request_id: str = ""
    name: str = ""  # NATS: the name the signing identity gives itself (its credentials' name)
    # HTTP with tokens: the id of the token presented (`fauxmad token inspect` shows it), allowed or refused (a
    # refused one as it claims to be), "static-token", "malformed" or "none given"
    token: str = ""
    # NATS, an image upload's end (`path` its upload subject, `request_id` the upload id): its outcome
    upload: UploadOutcome | None = None


class LogLine(Reply):
    machine_id: str
    app: str
    stream: Literal["stdout", "stderr"]
    line: str
    timestamp: float
    region: str = ""
    worker_id: str = ""
