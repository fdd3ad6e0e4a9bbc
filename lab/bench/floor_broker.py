"""The floor's broker: fauxmad's broker hop in plain nats-py, no fauxmad code (run with `python -m`).

`python -m lab.bench.floor_broker URL NAMESPACE REGION RESPONDERS DEADLINE_S [--follow]` answers a create request
on `<NAMESPACE>.create.<REGION>` (queue group `brokers`) as a fauxmad broker does, with nothing else: it scatters
the offer request to the region's responders, gathers until all RESPONDERS have answered or DEADLINE_S has passed,
picks the most free (less what it picked and has not heard back about), reserves there with a request (the
reserve carries the create's audit record, as a fauxmad reserve does) and answers with the reserve's reply.
`--follow`: it also follows the routing index (`<NAMESPACE>.index.>`) with an ordered consumer from its
end, as every fauxmad broker keeps a replica of the index.

It prints `ready` once subscribed and exits when its stdin closes. Imports only `lab.bench.floor_auction` (the
standard library and nats-py), so what it costs is the broker hop's, under any implementation of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import uuid
from typing import Any

import nats
import uvloop
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from lab.bench.floor_auction import FloorSubjects, Gatherer, pick

RESERVE_TIMEOUT = 2.0  # as the broker's AuctionConfig.reserve_timeout


async def main(args: argparse.Namespace) -> None:
    subjects = FloorSubjects(args.namespace)
    nc = await nats.connect(args.url.split(","), name=f"fauxmad-floor-broker-{args.namespace}")
    index: dict[str, bytes] = {}
    if args.follow:

        async def on_entry(msg: Msg) -> None:
            index[msg.subject.rsplit(".", 1)[1]] = msg.data

        await nc.jetstream().subscribe(
            f"{subjects.index}.>", cb=on_entry, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
        )
    gatherer = Gatherer(nc)
    await gatherer.start()
    pending: dict[str, int] = {}
    rng = random.Random(7)
    tasks: set[asyncio.Future[Any]] = set()

    async def create(msg: Msg) -> None:
        ask = json.loads(msg.data)
        offer_request = json.dumps({"app": ask["app"], "cpus": 1, "memory_mb": 1}).encode()
        offers = await gatherer.scatter(subjects.offers(args.region), offer_request, args.responders, args.deadline)
        chosen = pick(offers, pending, rng)
        if chosen is None:
            await msg.respond(json.dumps({"error": f"no offer within {args.deadline * 1000:g} ms"}).encode())
            return
        pending[chosen] = pending.get(chosen, 0) + 1
        audit = {"subject": msg.subject, "caller": "unsigned", "status": 200}
        reserve = {"id": uuid.uuid4().hex[:14], "app": ask["app"], "cpus": 1, "memory_mb": 1, "audit": audit}
        try:
            reply = await nc.request(subjects.reserve(chosen), json.dumps(reserve).encode(), timeout=RESERVE_TIMEOUT)
        except Exception as exc:  # the client is told, not left to its own timeout
            await msg.respond(json.dumps({"error": f"reserve on {chosen}: {exc!r}"}).encode())
            return
        finally:
            pending[chosen] -= 1
        await msg.respond(reply.data)

    async def on_create(msg: Msg) -> None:
        task = asyncio.ensure_future(create(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(subjects.create(args.region), queue="brokers", cb=on_create)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    await nc.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the broker of fauxmad's placement floor")
    parser.add_argument("url")
    parser.add_argument("namespace")
    parser.add_argument("region")
    parser.add_argument("responders", type=int)
    parser.add_argument("deadline", type=float)
    parser.add_argument("--follow", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    uvloop.run(main(parse(sys.argv[1:])))
