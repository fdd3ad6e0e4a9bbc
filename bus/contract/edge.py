"""What edge proxies publish: a machine that refused a connection, and the machines each proxy served
lately (shared idleness). Hints for the reconcilers and the other proxies, never commands.
"""

from __future__ import annotations

from bus.contract.base import Reply


class ProxyActivity(Reply):
    """`fauxmad.v1.proxy.activity.<app>`: the machines one edge proxy served (or holds a request on) since its
    last report, sent once an autostop round (every second) when there are any. Every proxy counts them as
    used, so a machine busy only through another proxy is not stopped as idle."""

    proxy: str  # the sender's id, so it skips its own reports
    app: str
    machines: list[str]


class ProxyUnreachable(Reply):
    """`fauxmad.v1.proxy.unreachable.<app>.<machine_id>`: a machine refused or dropped a proxy's connection.

    A hint, not a verdict: anyone who can publish there can send one, so a reconciler asks the worker itself
    before it acts on it."""

    app: str
    machine_id: str
    worker_id: str
    region: str
    proxy_region: str = ""
    error: str = ""
    at: float = 0.0
