"""The backhaul's preamble: what an edge proxy on another host says to a worker before the bytes of a request.

A machine listens on its host's loopback only. An edge proxy on another host connects to the machine's
worker (`WorkerInfo.address`, port `WorkerInfo.backhaul`) and sends one line naming the machine and its
port (or `ping`); the worker answers `ok` once it holds a connection to that port on its loopback, or
`error <why>` and closes. After `ok` the connection is the machine's: bytes both ways, unchanged, until
either side closes. One line each way (not a header block, not a frame) because it is read once per
connection and the proxy then pools the connection for many requests: the preamble costs one round trip
per new connection, never one per request.

Both sides import it from here (the proxy is `orchestrator`, the worker `workers`; both import `bus`).
"""

from __future__ import annotations

import re

MAGIC = "FAUXMAD-BACKHAUL/1"
OK = b"ok\n"
ERROR = "error"
MAX_LINE = 256  # bytes of a preamble or an answer, newline included
_MACHINE_ID = re.compile(r"[0-9a-f]{14}")  # `base.MachineId`
# On a secure fleet, the roles whose certificates may open a machine's connection through a worker's backhaul:
# the edge's own, and the operator's (which may do anything). A deployer's certificate comes from the same CA, but
# the backhaul would take it to any app's machines; the role is in the certificate (its organizational unit).
BACKHAUL_ROLES = frozenset({"proxy", "operator"})


class PreambleError(ValueError):
    """A preamble or answer that is not the backhaul's: the reason, in one line."""


def request_line(machine_id: str, port: int) -> bytes:
    """`FAUXMAD-BACKHAUL/1 <machine id> <port>\\n`."""
    return f"{MAGIC} {machine_id} {port}\n".encode("ascii")


def ping_line() -> bytes:
    """`FAUXMAD-BACKHAUL/1 ping\n`: is the host there? The worker answers `ok` itself, and closes."""
    return f"{MAGIC} ping\n".encode("ascii")


def parse_request(line: bytes) -> tuple[str, int] | None:
    """The machine id and port a preamble names, None for a ping; `PreambleError` for anything else."""
    try:
        text = line.decode("ascii").rstrip("\r\n")
    except UnicodeDecodeError:
        raise PreambleError("the preamble is not ASCII") from None
    parts = text.split(" ")
    if parts == [MAGIC, "ping"]:
        return None
    if len(parts) != 3 or parts[0] != MAGIC:
        raise PreambleError(f"expected '{MAGIC} <machine id> <port>'")
    machine_id, port = parts[1], parts[2]
    if not _MACHINE_ID.fullmatch(machine_id):
        raise PreambleError("the preamble names no valid machine id")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise PreambleError("the preamble names no valid port")
    return machine_id, int(port)


def error_line(why: str) -> bytes:
    """`error <why>\\n`, one line, cut to fit `MAX_LINE`."""
    flat = " ".join(why.split())
    return f"{ERROR} {flat}"[: MAX_LINE - 1].encode("ascii", "replace") + b"\n"
