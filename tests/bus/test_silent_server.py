"""A long-running process notices a server gone silent (no FIN, no RST: a host's cable cut) within seconds, from
its first second on.

Workers, brokers, the API, the edge and the operator connect as a command does (fail fast when there is no
server) and then ride out outages as an agent (`reconnect_forever`). nats-py's ping loop sleeps its first
interval as it was set at connect: it was the command's 20 s, so in a fleet's first 20 s a worker connected
through a server whose host was cut answered nothing for 20 s or more, and the keyed creates of
tests/hosts/test_cluster_on_hosts.py (whose fleet is seconds old when it cuts a host) took 16 to 103 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

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


FROZEN_MEMBER = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1], ping_interval=3600)  # it never finds out itself
    async def answer(msg): await msg.respond(b"frozen")
    await nc.subscribe("fauxmad.test.verb", queue="q", cb=answer)
    await nc.flush()
    print("subscribed", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_silent_client_leaves_its_queue_group_within_seconds(fresh_nats: EmbeddedNats) -> None:
    """A member of a queue group whose host froze (or was cut off) stops taking the group's requests once the
    server drops its connection (`bus.local.server_options`: 4 to 6 s); with nats-server's default it took
    about half of them for minutes, answering none (a worker's verbs after a heal, through its stale
    connection)."""
    member = subprocess.Popen([sys.executable, "-c", FROZEN_MEMBER, fresh_nats.url], stdout=subprocess.PIPE)
    try:
        assert member.stdout is not None and member.stdout.readline() == b"subscribed\n"
        os.kill(member.pid, signal.SIGSTOP)

        async def run() -> None:
            live = await connect(fresh_nats.url, "fauxmad-test-live-member")
            asker = await connect(fresh_nats.url, "fauxmad-test-asker")

            async def answer(msg: Msg) -> None:
                await msg.respond(b"live")

            await live.subscribe("fauxmad.test.verb", queue="q", cb=answer)
            await live.flush()

            async def answered(n: int) -> int:
                count = 0
                for _ in range(n):
                    with contextlib.suppress(TimeoutError, NatsTimeout):
                        count += (await asker.request("fauxmad.test.verb", b"", timeout=0.2)).data == b"live"
                return count

            try:
                assert await answered(16) < 16  # the frozen member takes some: the setting is what ends it

                async def all_answered() -> bool:
                    return await answered(10) == 10

                await until(all_answered, "every request answered by the live member", timeout=20)
            finally:
                await live.close()
                await asker.close()

        arun(run())
    finally:
        member.kill()
        member.wait()
