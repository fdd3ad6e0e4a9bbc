"""One responder of the placement floor: a plain nats-py process, no fauxmad code (run as a script).

`python floor_responder.py URL REGION WORKER_ID LMDB_DIR STREAM_SUBJECT` answers, as a fauxmad worker
would and with nothing else:

- an offer request on `floor.v1.offers.<REGION>` with a small JSON offer (its id and free CPUs);
- a reserve request on `floor.v1.worker.<WORKER_ID>.machines.reserve` with one LMDB put in its own
  write transaction (the environment opened with sync on, so the commit fsyncs) and one JetStream
  publish on STREAM_SUBJECT whose ack it awaits, then the record as the reply. Each reserve runs as a
  task, so JetStream acks of reserves arriving together overlap (the LMDB commits do not: one at a
  time, on the loop, as the plainest code would).

It prints `ready` once subscribed and exits when its stdin closes. Imports nothing from this project
(it is run by path, with only the standard library, nats-py, uvloop and lmdb), so what it costs is
the floor under any implementation of the protocol.
"""

from __future__ import annotations

import asyncio
import json
import sys

import lmdb
import nats
import uvloop
from nats.aio.msg import Msg

CPUS = 1_000_000  # room for everything: the floor measures the protocol, never a refusal


async def main(url: str, region: str, worker_id: str, path: str, stream_subject: str) -> None:
    env = lmdb.open(path, map_size=1 << 30, sync=True, metasync=True)
    nc = await nats.connect(url.split(","), name=f"fauxmad-floor-{worker_id}")
    js = nc.jetstream()
    state = {"free": CPUS}
    tasks: set[asyncio.Task[None]] = set()

    async def offer(msg: Msg) -> None:
        body = {"worker_id": worker_id, "region": region, "free_cpus": state["free"]}
        await msg.respond(json.dumps(body).encode())

    async def reserve(msg: Msg) -> None:
        request = json.loads(msg.data)
        record = json.dumps({"id": request["id"], "worker_id": worker_id, "state": "created"}).encode()
        with env.begin(write=True) as txn:
            txn.put(request["id"].encode(), record)
        state["free"] -= int(request.get("cpus", 1))
        await js.publish(stream_subject, record)
        await msg.respond(record)

    async def on_reserve(msg: Msg) -> None:
        task = asyncio.ensure_future(reserve(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(f"floor.v1.offers.{region}", cb=offer)
    await nc.subscribe(f"floor.v1.worker.{worker_id}.machines.reserve", cb=on_reserve)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    await nc.close()
    env.close()


if __name__ == "__main__":
    uvloop.run(main(*sys.argv[1:6]))
