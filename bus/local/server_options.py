"""What every nats-server of a fauxmad fleet is told about its clients, beside its listeners and JetStream.

Why: a server holds a client's subscriptions until it knows the connection is gone. A process that dies says so
(its socket closes), but a host cut off or frozen says nothing, and nats-server's own check is a PING every two
minutes, two of them unanswered: four minutes or more. Meanwhile the client has found its connection stale
(`bus.transport.connection`: 3 to 4 s) and made a new one, with the same subscriptions, queue groups
included. A request on a queue subject then goes to one member of the group, the server's local members first,
and the stale one takes it and answers nothing: a worker's verbs (its endpoints are a `nats.micro` service,
whose queue group cannot be switched off) and the brokers' API could go unanswered for minutes after a heal.
Measured with one member frozen and one live: 3 to 6 of 10 requests answered for as long as it ran; with
these settings, 10 of 10 from 6.5 s after the freeze (`tests/bus/test_silent_server.py` keeps it so).

So the server pings every client each `PING_INTERVAL` and drops one that leaves `PING_MAX` pings unanswered:
a silent connection is gone 4 to 6 s after its last word, about when its client has reconnected. A live
client answers from its reader (nats-py, as a busy event loop allows): the client's own check is stricter
(1 s x 3), so no live connection is dropped by this one first.
"""

from __future__ import annotations

PING_INTERVAL = "2s"
PING_MAX = 2

# the lines, in nats-server's config syntax, at the top level of a server's file
CLIENT_LIVENESS = (
    "# a silent client (its host cut off or frozen) is dropped 4 to 6 s after its last word, with its",
    "# subscriptions: the default (2m x 2) kept a stale member of a queue group taking requests for minutes",
    f'ping_interval: "{PING_INTERVAL}"',
    f"ping_max: {PING_MAX}",
)
