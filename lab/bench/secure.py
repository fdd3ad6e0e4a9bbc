"""`fauxmad bench secure`: what security costs a create, open fleet vs secure fleet in the same run.

Two dev fleets of the same shape run side by side: one open (plain NATS, no identities), one secure
(`FleetSpec(secure=True)`: mutual TLS on every connection, an nkey identity per process, permissions
enforced by nats-server). Creates (reserve only, so process starts do not drown the difference)
alternate between them one at a time, so both see the same noise on a shared machine; the client of
the secure fleet is its operator, as `fauxmad dev --secure` prints.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import msgspec
import uvloop

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from lab.bench.report import Report, host_info, latency_table
from lab.bench.stats import Latency, summarize
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec

Progress = Callable[[str], None]
APP = "bench"
REGION = "mad"
CONFIG = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=1))


class SecureOptions(msgspec.Struct, frozen=True, kw_only=True):
    creates: int = 500  # each way
    workers: int = 3
    warmup: int = 50


class SecureResult(msgspec.Struct, kw_only=True):
    options: SecureOptions
    open_create: Latency
    secure_create: Latency
    added_p50_ms: float
    added_p99_ms: float
    host: dict[str, object]


def fleet_spec(options: SecureOptions, *, secure: bool) -> FleetSpec:
    return FleetSpec(
        regions=[REGION], workers_per_region=options.workers, cpus=100_000, memory_mb=10_000_000, secure=secure
    )


async def _measure(
    open_url: str, secure: tuple[str, str | None], options: SecureOptions, progress: Progress
) -> SecureResult:
    secure_url, operator = secure
    clients = [
        await FleetClient.connect(open_url, "fauxmad-bench"),
        await FleetClient.connect(secure_url, "fauxmad-bench", creds=operator),
    ]
    samples: list[list[float]] = [[], []]
    made: list[list[str]] = [[], []]
    try:
        progress(f"{options.warmup} warm-up and {options.creates} measured creates each way, alternating")
        for n in range(options.warmup + options.creates):
            for side, client in enumerate(clients):
                t0 = time.perf_counter()
                machine = await client.create(APP, CreateRequest(region=REGION, config=CONFIG, skip_launch=True))
                took = time.perf_counter() - t0
                made[side].append(machine.id)
                if n >= options.warmup:
                    samples[side].append(took)
        progress("destroying the machines")
        for side, client in enumerate(clients):
            for machine_id in made[side]:
                await client.destroy(APP, machine_id, force=True)
    finally:
        for client in clients:
            await client.close()
    open_create, secure_create = summarize(samples[0]), summarize(samples[1])
    return SecureResult(
        options=options,
        open_create=open_create,
        secure_create=secure_create,
        added_p50_ms=round(secure_create.p50_ms - open_create.p50_ms, 3),
        added_p99_ms=round(secure_create.p99_ms - open_create.p99_ms, 3),
        host=host_info(),
    )


def run_secure_bench(options: SecureOptions, progress: Progress = lambda line: None) -> SecureResult:
    progress(f"starting two fleets of {options.workers} workers and a broker: one open, one secure (mutual TLS)")
    with contextlib.ExitStack() as stack:
        opened = stack.enter_context(DevFleet(fleet_spec(options, secure=False)))
        secured = stack.enter_context(DevFleet(fleet_spec(options, secure=True)))
        return uvloop.run(_measure(opened.url, (secured.url, secured.operator_creds), options, progress))


def report(result: SecureResult) -> Report:
    table = latency_table(
        "create (reserve only), same run, alternating",
        [("open (plain NATS)", result.open_create), ("secure (mTLS + nkeys + permissions)", result.secure_create)],
    )
    note = f"security adds {result.added_p50_ms:.3f} ms at p50 and {result.added_p99_ms:.3f} ms at p99"
    return Report(tables=(table,), notes=(note,))
