"""How long each side waits for a machine verb, in one table: the CLI's client, the HTTP API and the broker read it.

A caller (the client, the API) waits `caller_wait(verb)`; the broker, which forwards the verb to the machine's
worker, waits `HOP_MARGIN` less, so that a worker that does not answer is reported by the broker in words ("worker
... did not answer") before the caller's own clock runs out. A verb with a timeout of its own (stop, wait, exec)
is waited for that long plus a margin; the others for a base (`DEFAULT_WAIT`, which a client may set) plus what the
verb's work may add: running a process, pulling an image, stopping one first.
"""

from __future__ import annotations

DEFAULT_WAIT = 10.0  # seconds for a verb that reads or flips a state (get, list, signal, suspend, lease)
EXTRA_WAIT = {  # on top of the base, for a verb that does more
    "create": 20.0,  # an auction, a reserve and a start (which may pull an image)
    "start": 20.0,  # may pull an image, or wait for a stop in flight to end first (15 s at most)
    "resume": 20.0,  # starts the machine again when its suspended process is gone
    "update": 30.0,  # stops the machine and starts its new config in place
    "destroy": 15.0,  # stops the machine first
}
OWN_TIMEOUT_WAIT = {  # a verb with a timeout of its own: that timeout, plus this
    "stop": 15.0,  # SIGKILL after the timeout, then the exit recorded
    "wait": 10.0,
    "exec": 10.0,
}
VOLUME_EXTRA_WAIT = {  # volume verbs, on top of the base
    "create": 600.0,  # may restore a snapshot's bytes from the object store
    "snapshot": 600.0,  # copies the volume's bytes into the object store
    "extend": 60.0,
    "destroy": 60.0,
}
HOP_MARGIN = 2.0  # the broker waits this much less than its caller: enough to answer in words, no more


def caller_wait(verb: str, own_timeout: float | None = None, *, base: float = DEFAULT_WAIT) -> float:
    """Seconds a caller of the brokers' subjects waits for `verb`'s answer."""
    if verb in OWN_TIMEOUT_WAIT:
        return (own_timeout if own_timeout is not None else base) + OWN_TIMEOUT_WAIT[verb]
    return base + EXTRA_WAIT.get(verb, 0.0)


def broker_wait(verb: str, own_timeout: float | None = None) -> float:
    """Seconds the broker waits for the worker it forwards `verb` to: its caller's wait less `HOP_MARGIN`."""
    return caller_wait(verb, own_timeout) - HOP_MARGIN


def volume_wait(verb: str, *, base: float = DEFAULT_WAIT) -> float:
    """Seconds a caller waits for a volume verb's answer."""
    return base + VOLUME_EXTRA_WAIT.get(verb, 0.0)
