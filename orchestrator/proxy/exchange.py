"""One request as the proxy's parts pass it along (`Exchange`), and the answer the proxy gives itself (`Refused`).

Its own module so that choosing a machine (`pick`), resuming ahead (`ahead`) and forwarding (`forward`)
share the request's state and can refuse it without importing the connection handler (`server`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator.proxy.deadlines import Watch
from orchestrator.proxy.request import Request


class Refused(Exception):
    """The proxy answers this request itself: status, one line, maybe Retry-After."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


class Exchange:
    """One request as it goes: what the handler needs to finish it and to account for it."""

    __slots__ = (
        "app",
        "body_error",
        "client_keep",
        "framing",
        "head",
        "machine",
        "region",
        "request",
        "request_id",
        "responded",
        "safe",
        "status",
        "uploading",
        "waking",
        "watch",
    )

    def __init__(self, request: Request, request_id: str, watch: Watch) -> None:
        self.request = request
        self.head = request.head
        self.watch = watch  # the connection's deadline (the response head's wait)
        self.request_id = request_id
        self.app = ""
        self.machine: str | None = None
        self.region = ""
        self.status = 0
        self.responded = False  # a byte of the response went to the client
        self.client_keep = False
        self.framing = request.framing
        self.uploading = False  # the request's body is being sent upstream beside the response's wait
        self.body_error: BaseException | None = None  # why the client's body failed (its relay cancels the wait)
        self.safe = False  # idempotent and without a body: it may be sent twice
        self.waking: asyncio.Future[Any] | None = None  # the resume this request was sent ahead of
