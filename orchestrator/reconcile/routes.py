"""Where the reconciler's machine verbs go: to the machine's worker, or through the brokers' API of the app.

Why two routes: the operator's role may speak to every worker (`fauxmad.v1.worker.<id>.machines.<verb>`), and
the reconciler asks workers straight away, one hop, even while no broker answers. A deployer's role names its
app's API subjects and no worker's (docs/how-to/secure-fleet.md): granting it worker subjects would let it act on every
app's machines, because nothing in a worker subject names the app. So a reconciler acting as any other identity
sends the same verbs to `fauxmad.v1.api.apps.<app>.machines.<verb>`: the brokers forward each one to the
machine's worker after checking that the machine belongs to the app, and a list names the worker it is about
(`ListRequest.worker_id`), so a silent worker is still an error rather than an empty list.
"""

from __future__ import annotations

from collections.abc import Callable

from bus.contract import subjects

Route = Callable[[str, str, str], str]
"""(app, worker id, verb) -> the subject the verb is sent to."""


def to_workers(app: str, worker_id: str, verb: str) -> str:
    return subjects.worker_machines(worker_id, verb)


def through_brokers(app: str, worker_id: str, verb: str) -> str:
    return subjects.api_machines(app, verb)


def for_role(role: str | None) -> Route:
    """An open fleet (no role) and the operator ask workers; any other identity goes through the brokers."""
    return to_workers if role in (None, "operator") else through_brokers
