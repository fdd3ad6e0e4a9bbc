"""One responder of the placement floor: a plain nats-py process, no fauxmad code (run as a script).

`python floor_responder.py URL REGION WORKER_ID LMDB_DIR --offers S --reserve S --event S [--index P] [--audit S]`
answers, as a fauxmad worker would and with nothing else:

- an offer request on `--offers` with a small JSON offer (its id and free CPUs);
- a reserve request on `--reserve` with one LMDB put in its own write transaction (the environment opened with
  sync on, so the commit fsyncs) and one JetStream publish on `--event` whose ack it awaits, then the record as
  the reply. Each reserve runs as a task, so JetStream acks of reserves arriving together overlap (the LMDB
  commits do not: one at a time, on the loop, as the plainest code would).

With the contract's parts (`lab.bench.floor.Variant`): `--index P` also stores the machine's routing index entry
on `P.<machine id>` beside the event, both acks awaited before the reply (a fauxmad worker answers once its entry
is stored); `--audit S` publishes the reserve's audit record on S after the reply, from a second connection (as a
fauxmad worker's audit outbox does), its ack awaited off the reply's path.

It prints `ready` once subscribed and exits when its stdin closes. Imports nothing from this project
(it is run by path, with only the standard library, nats-py, uvloop and lmdb), so what it costs is
the floor under any implementation of the protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from typing import Any

import lmdb
import nats
import uvloop
from nats.aio.msg import Msg

CPUS = 1_000_000  # room for everything: the floor measures the protocol, never a refusal


async def main(args: argparse.Namespace) -> None:
    env = lmdb.open(args.lmdb_dir, map_size=1 << 30, sync=True, metasync=True)
    nc = await nats.connect(args.url.split(","), name=f"fauxmad-floor-{args.worker_id}")
    js = nc.jetstream()
    audit_nc = (
        await nats.connect(args.url.split(","), name=f"fauxmad-floor-{args.worker_id}-audit") if args.audit else None
    )
    audit_js = audit_nc.jetstream() if audit_nc is not None else None
    state = {"free": CPUS}
    tasks: set[asyncio.Future[Any]] = set()

    def spawn(coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def offer(msg: Msg) -> None:
        body = {"worker_id": args.worker_id, "region": args.region, "free_cpus": state["free"]}
        await msg.respond(json.dumps(body).encode())

    async def reserve(msg: Msg) -> None:
        request = json.loads(msg.data)
        machine_id = request["id"]
        record = json.dumps(
            {"id": machine_id, "worker_id": args.worker_id, "state": "created", "audit": request.get("audit")}
        ).encode()
        with env.begin(write=True) as txn:
            txn.put(machine_id.encode(), record)
        state["free"] -= int(request.get("cpus", 1))
        if args.index:
            entry = json.dumps({"worker_id": args.worker_id, "app": request.get("app")}).encode()
            await asyncio.gather(js.publish(args.event, record), js.publish(f"{args.index}.{machine_id}", entry))
        else:
            await js.publish(args.event, record)
        await msg.respond(record)
        if audit_js is not None:
            spawn(audit_js.publish(args.audit, record))

    await nc.subscribe(args.offers, cb=offer)

    async def on_reserve(msg: Msg) -> None:
        spawn(reserve(msg))

    await nc.subscribe(args.reserve, cb=on_reserve)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    await nc.close()
    if audit_nc is not None:
        await audit_nc.close()
    env.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one responder of fauxmad's placement floor")
    for name in ("url", "region", "worker_id", "lmdb_dir"):
        parser.add_argument(name)
    parser.add_argument("--offers", required=True)
    parser.add_argument("--reserve", required=True)
    parser.add_argument("--event", required=True)
    parser.add_argument("--index", default=None)
    parser.add_argument("--audit", default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    uvloop.run(main(parse(sys.argv[1:])))
