"""A long-running process notices a server gone silent (no FIN, no RST: a host's cable cut) within seconds, from
its first second on.

Workers, brokers, the API, the edge and the operator connect as a command does (fail fast when there is no
server) and then ride out outages as an agent (`reconnect_forever`). nats-py's ping loop sleeps its first
interval as it was set at connect: it was the command's 20 s, so in a fleet's first 20 s a worker connected
through a server whose host was cut answered nothing for 20 s or more, and the keyed creates of
tests/hosts/test_cluster_on_hosts.py (whose fleet is seconds old when it cuts a host) took 16 to 103 s.
"""

from __future__ import annotations

import os
import signal

from bus.local.embedded import EmbeddedNats
from bus.transport.connection import connect
from tests.helpers import arun, until


def test_a_process_that_reconnects_forever_notices_a_silent_server_in_its_first_seconds(
    fresh_nats: EmbeddedNats,
) -> None:
    async def run() -> None:
        nc = await connect(fresh_nats.url, "fauxmad-test-agent", reconnect_forever=True)
        assert fresh_nats.process is not None
        pid = fresh_nats.process.pid
        os.kill(pid, signal.SIGSTOP)  # silent: the socket stays open, nothing answers
        try:

            async def noticed() -> bool:
                return not nc.is_connected

            # an agent's pings: stale after 3 unanswered, one a second (4 s); the command's first ping came at 20 s
            await until(noticed, "the connection to the silent server seen stale", timeout=12)
        finally:
            os.kill(pid, signal.SIGCONT)
            await nc.close()

    arun(run())
