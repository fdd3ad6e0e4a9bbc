"""One or more worker agents in one process, until cancelled (the CLI cancels on SIGTERM/SIGINT) or a lost bus.

Several logical workers per process is for benchmarks of large regions: each still has its own
subscriptions, service, LMDB environment and writer thread, running the same code as a worker of its own,
but four things are the process's (issue 44, `service.Shared`), so that a simulated fleet of 1,000 measures
placement, not its own background: its background jobs (one job puller and desk, the first logical
worker's: the process's CPU is one, so one puller bounds it), its heartbeats' timer (`BeatGroup`), its NATS
connection, and its watch of the fleet's secrets. A connection is a ping a second, a flusher, a reader and
a closed-connection poll in the process, and a socket in nats-server; a watch is an ordered consumer in
nats-server and a flow-control check four times a second in the process. Its heartbeats are one KV put a process
an interval, under its beat group's key (`heartbeat.BeatGroup`, `bus.contract.beats`: every reader still sees one
heartbeat per worker, and all of them gone when the group's key expires).
A real fleet (one worker per process) is unchanged: each worker connects, watches and beats its key on its own.
Stopping never stops machines: the agent says how many it leaves running, and a restart re-adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import msgspec

from bus.contract.errors import Unreachable
from bus.transport.connection import Connection, connect
from workers.agent.config import WorkerConfig
from workers.agent.heartbeat import BeatGroup
from workers.agent.service import Shared, WorkerAgent
from workers.lifecycle import steps


async def run_workers(
    configs: list[WorkerConfig],
    on_ready: Callable[[], None] = lambda: None,
    on_stopped: Callable[[int], None] = lambda running: None,
) -> None:
    """Run one or more workers in this process until cancelled (SIGTERM/SIGINT: the CLI's `serve` cancels it)
    or a worker's bus connection ends for good (`Unreachable`); their machines keep running after.
    `on_ready` runs once every worker serves (the CLI says so there); `on_stopped(n)` once they stopped
    serving (if they did), with the number of machines they leave running."""
    steps.install_from_environment()  # a test's hooks at the lifecycle's named steps, if one named them
    beats = BeatGroup(configs[0].heartbeat_interval, len(configs)) if len(configs) > 1 else None
    # one job puller (and job desk) per process: its first logical worker's (issue 44)
    configs = [configs[0], *(msgspec.structs.replace(config, serve_jobs=False) for config in configs[1:])]
    agents: list[WorkerAgent] = []
    nc: Connection | None = None
    shared: Shared | None = None
    if beats is not None:  # one connection for the process's logical workers; a lost bus stops them all

        def closed(reason: str) -> None:
            for agent in agents:
                agent.on_bus_closed(reason)

        first = configs[0]
        name = f"fauxmad-worker-{first.worker_id}+{len(configs) - 1}"
        nc = await connect(first.nats_url, name, reconnect_forever=True, on_closed=closed)
        shared = Shared(nc, beats)
    agents += [WorkerAgent(config, shared) for config in configs]
    running: list[asyncio.Task[None]] = []
    served = False
    try:
        for agent in agents:
            await agent.start()
        on_ready()
        served = True
        # any agent stopping (a lost bus stops one) ends the process
        running = [asyncio.create_task(agent.run_forever()) for agent in agents]
        if beats is not None:
            running.append(asyncio.create_task(beats.run()))
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in running:
            task.cancel()
        left = sum(agent.machines_running() for agent in agents)
        await asyncio.gather(*[agent.close() for agent in agents], return_exceptions=True)
        if nc is not None:  # after its workers: their closes answer and flush what is in flight on it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)
        if served:
            on_stopped(left)
    lost = [agent.bus_lost for agent in agents if agent.bus_lost]
    if lost:
        raise Unreachable(f"worker stopped: {lost[0]}")


async def run_worker(config: WorkerConfig) -> None:
    await run_workers([config])
