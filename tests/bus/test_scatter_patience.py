"""Silence is not an answer (`bus.transport.scatter`): a scatter that has heard nobody at its deadline and was
given `patience` waits on for the first reply, and one given none ends at the deadline as before. CI34 failed a
create with "no capacity ... no answer within deadline" from a region of two live workers, on a host running four
test files at a time; here the one responder answers 300 ms late, six deadlines of 50 ms, on a real nats-server."""

from __future__ import annotations

import asyncio

from bus.transport.scatter import Scatterer
from tests.helpers import arun, connect_nats

LATE = 0.3  # seconds the responder waits before it answers
DEADLINE = 0.05


def test_a_scatter_nobody_answered_by_its_deadline_waits_for_the_first_reply_within_its_patience(
    nats_url: str,
) -> None:
    async def main() -> None:
        responder = await connect_nats(nats_url)
        nc = await connect_nats(nats_url)
        try:

            async def late(msg: object) -> None:
                await asyncio.sleep(LATE)
                await msg.respond(b"7")  # type: ignore[attr-defined]

            await responder.subscribe("t.patience", cb=late)
            await responder.flush()
            scatterer = Scatterer(nc)
            await scatterer.start()
            await nc.flush()

            patient = await scatterer.scatter("t.patience", b"", int, expected=2, deadline=DEADLINE, patience=LATE * 10)
            assert patient.replies == [7] and patient.timed_out, patient

            # without patience, the deadline ends it: the late reply never counts (it comes six deadlines on)
            impatient = await scatterer.scatter("t.patience", b"", int, expected=2, deadline=DEADLINE)
            assert impatient.replies == [] and impatient.timed_out, impatient
            await scatterer.close()
        finally:
            await nc.close()
            await responder.close()

    arun(main())
