"""One or more worker agents in one process, until SIGTERM/SIGINT or a lost bus.

Several logical workers per process is for benchmarks of large regions: each still has its own
connection, LMDB environment and writer thread, running the same code as a worker of its own.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from bus.contract.errors import Unreachable
from workers.agent.config import WorkerConfig
from workers.agent.service import WorkerAgent


async def run_workers(configs: list[WorkerConfig], on_ready: Callable[[], None] = lambda: None) -> None:
    """Run one or more workers in this process until SIGTERM/SIGINT; their machines keep running after.
    `on_ready` runs once every worker serves (the CLI says so there)."""
    agents = [WorkerAgent(config) for config in configs]
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for agent in agents:
            agent.request_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_all)
    try:
        for agent in agents:
            await agent.start()
        on_ready()
        # any agent stopping (a signal stops all; a lost bus stops one) ends the process
        await asyncio.wait(
            [asyncio.create_task(agent.run_forever()) for agent in agents], return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        await asyncio.gather(*[agent.close() for agent in agents], return_exceptions=True)
    lost = [agent.bus_lost for agent in agents if agent.bus_lost]
    if lost:
        raise Unreachable(f"worker stopped: {lost[0]}")


async def run_worker(config: WorkerConfig) -> None:
    await run_workers([config])
