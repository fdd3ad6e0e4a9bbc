"""The outbox's wire (`bus.transport.batch_publish`) against a real nats-server: each message of a round gets its own
outcome, whatever the others' were, and an ack that comes after its round gave up changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from bus.transport.batch_publish import BatchPublisher, Refused
from tests.helpers import arun


def test_each_message_gets_its_own_outcome(nats_url: str, unique: Callable[[str], str]) -> None:
    """Stored, deduplicated (still stored: None), refused by JetStream, and no stream at all."""
    stream, subject = unique("S"), unique("s")

    async def main() -> tuple[list[BaseException | None], int]:
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{subject}.>"]))
        publisher = BatchPublisher(nc, timeout=2.0)
        outcomes = await publisher.send(
            [
                (f"{subject}.a", b"1", {"Nats-Msg-Id": "one"}),
                (f"{subject}.a", b"1", {"Nats-Msg-Id": "one"}),  # the same again: dropped as a duplicate
                (f"{subject}.b", b"2", {"Nats-Expected-Stream": "not-" + stream}),  # an error reply
                (unique("nostream"), b"3", None),  # nobody takes it: a 503 status reply
                (f"{subject}.c", b"4", None),
            ]
        )
        stored = (await js.stream_info(stream)).state.messages
        await js.delete_stream(stream)
        await nc.close()
        return outcomes, stored

    outcomes, stored = arun(main())
    assert outcomes[0] is None and outcomes[1] is None and outcomes[4] is None
    assert isinstance(outcomes[2], Refused)
    assert isinstance(outcomes[3], Refused) and "503" in str(outcomes[3])
    assert stored == 2


def test_an_ack_after_the_deadline_is_a_timeout_and_matches_nothing_later(
    nats_url: str, unique: Callable[[str], str]
) -> None:
    """A responder that answers each message 0.3 s late: the first round gives up after 0.1 s; its late
    ack arrives while the second round waits, and the second round still waits for its own."""
    slow = unique("slow")

    answered: list[bytes] = []  # the messages whose ack is on its way, in the order they were answered

    async def main() -> tuple[list[BaseException | None], list[BaseException | None], list[bytes]]:
        nc = await nats.connect(nats_url)

        async def answer_late(msg: Msg) -> None:
            # the late ack is the scenario: it arrives while the second round waits
            await asyncio.sleep(0.3)
            answered.append(msg.data)
            await msg.respond(b'{"stream":"X","seq":1}')

        async def on_msg(msg: Msg) -> None:
            asyncio.get_running_loop().create_task(answer_late(msg))

        await nc.subscribe(slow, cb=on_msg)
        publisher = BatchPublisher(nc, timeout=0.1)
        first = await publisher.send([(slow, b"late", None)])
        publisher.timeout = 2.0
        second = await publisher.send([(slow, b"in time", None)])
        by_then = list(answered)
        await nc.close()
        return first, second, by_then

    first, second, by_then = arun(main())
    assert isinstance(first[0], TimeoutError)
    assert second == [None]
    # an ordering, not a time: the second round ended only once its own message was answered, so the first
    # round's late ack (answered before it) did not stand in for the second's
    assert by_then == [b"late", b"in time"], by_then


def test_a_round_on_a_closed_connection_fails_as_a_whole(nats_url: str) -> None:
    async def main() -> list[BaseException | None]:
        nc = await nats.connect(nats_url)
        publisher = BatchPublisher(nc, timeout=1.0)
        assert await publisher.send([]) == []
        await publisher.send([("warm.up", b"", None)])  # subscribes; no stream: refused, that is all
        await nc.close()
        return await publisher.send([("a.b", b"1", None), ("a.c", b"2", None)])

    outcomes = arun(main())
    assert len(outcomes) == 2 and all(isinstance(outcome, Exception) for outcome in outcomes)
