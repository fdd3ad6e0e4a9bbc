"""Records of the fleet's streams that are not machine events: machines' output lines (`FAUXMAD_LOGS`) and
the audit trail of mutating requests (`FAUXMAD_AUDIT`).
"""

from __future__ import annotations

from typing import Literal

from bus.contract.base import Reply


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


class LogLine(Reply):
    machine_id: str
    app: str
    stream: Literal["stdout", "stderr"]
    line: str
    timestamp: float
    region: str = ""
    worker_id: str = ""
