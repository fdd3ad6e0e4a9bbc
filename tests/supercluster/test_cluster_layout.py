"""Three nats-servers in one cluster (routes, no gateways: the usual HA setup), no layout variable anywhere: the
fleet's layout (KV fauxmad_layout) makes every bucket and stream R3, and a kill -9 of each server in turn under
create load loses nothing and hides no worker. An R1 fleet moves to R3 with one command, with machines and
jobs running. A process told another layout refuses to start, in one line, writing nothing.

Workers, brokers and CLIs are given every server's URL and pick one at random, as on real hosts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bus.contract.errors import FauxmadError
from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from bus.stores.kv_keys import kv_keys
from bus.transport.fleet_layout import LAYOUT_BUCKET, read_layout
from bus.transport.jetstream import WORKER_TTL
from bus.transport.layout import REPLICAS_ENV, SUPERCLUSTER_ENV, Layout
from orchestrator.cli.layout_cmd import heard_again, live_workers
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from orchestrator.logs import LogQuery
from orchestrator.view.history import EventQuery
from tests.helpers import arun, connect_nats, wait_until
from tests.orchestrator.reconcile.test_reconcile import fauxmad

pytestmark = pytest.mark.timeout(400)

REGIONS = ["mad", "syd"]
TICKER = MachineConfig(cmd=["sh", "-c", "while true; do echo tick; sleep 0.2; done"], guest=Guest(cpus=1, memory_mb=16))
ATTEMPT = 8.0  # seconds one create may take under load while a server is down, before it is asked again
SLEEPER = MachineConfig(cmd=["sleep", "300"], guest=Guest(cpus=1, memory_mb=16))


def _no_layout_variables() -> None:
    for name in (SUPERCLUSTER_ENV, REPLICAS_ENV):
        assert name not in os.environ, f"{name} is set: this test is about a fleet told nothing"


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    _no_layout_variables()
    spec = FleetSpec(regions=REGIONS, workers_per_region=1, cpus=256, memory_mb=65536, cluster=3, brokers=2)
    with DevFleet(spec, progress=print) as running:
        yield running


async def _streams(url: str) -> dict[str, tuple[int, int]]:
    """Every stream: (replicas, last sequence)."""
    nc = await connect_nats(url)
    try:
        return {
            i.config.name: (i.config.num_replicas, i.state.last_seq)
            for i in await nc.jetstream().streams_info()
            if i.config.name
        }
    finally:
        await nc.close()


async def _whole(url: str, timeout: float) -> float:
    """Wait until every stream has a leader and every replica is current (a restarted server caught up)."""
    began = time.perf_counter()
    nc = await connect_nats(url)
    try:
        js = nc.jetstream(timeout=1.0)
        pending: list[str] = []
        while not pending:  # JetStream's meta leader may be being elected again (it was on the killed server)
            try:
                pending = [i.config.name for i in await js.streams_info() if i.config.name]
            except Exception:
                assert time.perf_counter() - began < timeout, f"JetStream did not answer within {timeout}s"
                await asyncio.sleep(0.2)
        while pending:
            try:
                cluster = (await js.stream_info(pending[0])).cluster
                if cluster and cluster.leader and all(p.current and not p.offline for p in cluster.replicas or []):
                    pending.pop(0)
                    continue
            except Exception:
                pass
            assert time.perf_counter() - began < timeout, f"streams not whole after {timeout}s: {pending}"
            await asyncio.sleep(0.2)
        return time.perf_counter() - began
    finally:
        await nc.close()


def test_three_servers_and_no_variable_make_every_bucket_and_stream_r3(fleet: DevFleet) -> None:
    streams = arun(_streams(fleet.url))
    assert f"KV_{LAYOUT_BUCKET}" in streams and "KV_fauxmad_workers" in streams and "FAUXMAD_JOBS_mad" in streams
    assert {name: r for name, (r, _) in streams.items() if r != 3} == {}

    async def stored() -> Layout | None:
        nc = await connect_nats(fleet.url)
        try:
            return await read_layout(nc.jetstream())
        finally:
            await nc.close()

    assert arun(stored()) == Layout(regions=(), replicas=3)
    shown = fauxmad(fleet, "fleet", "layout")
    assert shown.returncode == 0 and "one cluster, R3" in shown.stdout, shown.stdout + shown.stderr


def _retry_cli(fleet: DevFleet, *args: str, within: float = 30.0) -> Any:
    """A CLI command as a person runs it while a server is down: again (after a one-line error) until it passes."""
    give_up = time.perf_counter() + within
    while True:
        result = fauxmad(fleet, *args, timeout=60)
        if result.returncode == 0 or time.perf_counter() > give_up:
            return result
        time.sleep(0.5)


async def _listing(client: FleetClient) -> set[str]:
    """One `fauxmad workers`, asked again (twice, half a second apart) when the request was lost with a server:
    this client's own, or the one of the broker it reached (which reconnects to another in a quarter second)."""
    for attempt in range(3):
        try:
            return {w.worker_id for w in await asyncio.wait_for(client.workers(), 3.0)}
        except Exception as exc:
            if attempt == 2:
                return {f"error: {exc!r}"[:100]}
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def _more(stop: float, placed_after_kill: asyncio.Event, out: dict[str, Any]) -> bool:
    """Whether `_load`'s creators go on: for 7 s, then until a create asked after the kill is placed (30 s at most)."""
    now = time.perf_counter()
    if now < stop:
        return True
    return not placed_after_kill.is_set() and now < out.get("killed_at", now) + 30.0


async def _load(fleet: DevFleet, victim: str, out: dict[str, Any], killed: threading.Event) -> None:
    """7 s of keyed creates (each key asked again after an error or `ATTEMPT` seconds without an answer, until
    acknowledged, up to 30 s) and a look at the workers list every half second; `victim` killed 1.5 s in. The
    creates go on past the 7 s until one of a key first asked after the kill is acknowledged (up to 30 s after
    the kill): that machine's events are the "new events since the kill". While the streams led by the killed
    server elect new leaders (4 to 9 s, docs/how-to/supercluster.md) every create fails at once, and a creator
    whose request was lost with the server goes on asking for its key from before the kill: with a fixed 7 s,
    both creators could end on such keys and no create would be placed after the kill (a CI run saw that)."""
    assert fleet.cluster is not None
    cluster = fleet.cluster
    workers = set(fleet.worker_ids)
    client = await FleetClient.connect(fleet.url)
    stop = time.perf_counter() + 7.0

    placed_after_kill = asyncio.Event()

    def more() -> bool:
        return _more(stop, placed_after_kill, out)

    async def creator(n: int) -> None:
        i = 0
        while more():
            key = f"{victim}-{n}-{i}"
            first_asked = time.perf_counter()
            give_up = first_asked + 30.0
            while True:
                try:
                    request = CreateRequest(
                        region=REGIONS[n % 2], config=SLEEPER, skip_launch=True, idempotency_key=key
                    )
                    # a request in flight through the killed server is lost with it (NATS delivers at most once):
                    # its answer never comes, so each attempt has its own deadline and the key is asked again
                    out["acked"][key] = (await asyncio.wait_for(client.create("load", request), ATTEMPT)).id
                    if first_asked > out.get("killed_at", first_asked) and not placed_after_kill.is_set():
                        out["placed_after_kill"] = round(time.perf_counter() - out["killed_at"], 1)
                        placed_after_kill.set()
                    await asyncio.sleep(0.1)
                    break
                except Exception as exc:
                    lost = isinstance(exc, TimeoutError) and not isinstance(exc, FauxmadError)
                    why = f"no answer within {ATTEMPT:g}s" if lost else f"{type(exc).__name__}: {str(exc)[:80]}"
                    out["failures"][why] = out["failures"].get(why, 0) + 1
                    if time.perf_counter() > give_up:
                        out["abandoned"].append(key)
                        break
                    await asyncio.sleep(0.1)
            i += 1

    async def poll_workers() -> None:
        while time.perf_counter() < stop:
            seen = await _listing(client)
            if seen != workers:
                out["unlisted"].append((round(time.perf_counter() - out.get("killed_at", 0.0), 1), sorted(seen)))
            await asyncio.sleep(0.5)

    async def killer() -> None:
        # the create load runs before the first kill, so the kill lands under load
        await asyncio.sleep(1.5)
        out["killed_at"] = time.perf_counter()
        out["killed_wall"] = time.time()
        await asyncio.to_thread(cluster.kill, victim)
        killed.set()

    try:
        await asyncio.gather(killer(), poll_workers(), *(creator(n) for n in range(2)))
    finally:
        await client.close()


async def _since_kill(fleet: DevFleet, since: float, within: float = 30.0) -> tuple[int, int]:
    """Events of the load and log lines of the ticker since the kill, read again (as a person would) while a
    stream answers "try again in a few seconds", or has none yet: a worker's outbox holds what the events stream
    refused while it had no leader (7 s after a kill of the meta leader, in CI) and sends it once it has one, at
    most a second later, so a read in that second finds the stream back and the events not yet in it."""
    give_up = time.perf_counter() + within
    while True:
        client = await FleetClient.connect(fleet.url)
        try:
            events = await client.events(EventQuery(app="load", since=since), lambda seq, event: None)
            lines = await client.logs(LogQuery(app="ticker", since=since), lambda record: None)
            if (events and lines) or time.perf_counter() > give_up:
                return events, lines
        except Exception:
            if time.perf_counter() > give_up:
                raise
        finally:
            await client.close()
        await asyncio.sleep(0.5)


def _kill_under_load(fleet: DevFleet, victim: str) -> dict[str, Any]:
    """Kill -9 `victim` under load (`_load`); while it is down, `fauxmad workers`, a job, new events and log
    lines. Restart it and wait until every stream is whole again."""
    assert fleet.cluster is not None
    out: dict[str, Any] = {"acked": {}, "abandoned": [], "unlisted": [], "failures": {}}
    killed = threading.Event()
    thread = threading.Thread(target=lambda: arun(_load(fleet, victim, out, killed)))
    thread.start()
    try:
        assert killed.wait(30)
        listed = fauxmad(fleet, "workers", "--json", timeout=60)
        out["cli_workers"] = {w["worker_id"] for w in json.loads(listed.stdout)} if listed.returncode == 0 else set()
        job = _retry_cli(fleet, "job", "submit", "-a", "hajobs", "-r", "syd", "--wait", "--json", "--", "true")
        out["job"] = (job.returncode, job.stdout[-300:] + job.stderr[-300:])
    finally:
        thread.join(90)  # the creates go on for up to 30 s after the kill, a key for up to 30 s more
    out["events"], out["lines"] = arun(_since_kill(fleet, out["killed_wall"]))
    fleet.cluster.restart(victim)
    out["healed"] = arun(_whole(fleet.url, 90.0))
    return out


def test_kill_9_of_each_server_in_turn_under_create_load(fleet: DevFleet) -> None:
    assert fleet.cluster is not None

    async def start_ticker() -> str:
        client = await FleetClient.connect(fleet.url)
        try:
            return (await client.create("ticker", CreateRequest(region="mad", config=TICKER))).id
        finally:
            await client.close()

    arun(start_ticker())
    acked: dict[str, str] = {}
    abandoned: list[str] = []
    for victim in list(fleet.cluster.servers):
        run = _kill_under_load(fleet, victim)
        print(
            f"\nkilled {victim}: {len(run['acked'])} creates acknowledged, {len(run['abandoned'])} given up; "
            f"workers unlisted at {run['unlisted']}; events {run['events']}, log lines {run['lines']} since the "
            f"kill; the first create asked after the kill placed {run.get('placed_after_kill')}s after it; whole again "
            f"{run['healed']:.1f}s after the restart; failed attempts: {run['failures']}"
        )
        assert run["unlisted"] == [], f"workers missing while {victim} was down: {run['unlisted']}"
        assert run["cli_workers"] == set(fleet.worker_ids), run
        assert run["job"][0] == 0, run["job"]  # --wait: exit 0 only when the job succeeded
        assert run["events"] > 0 and run["lines"] > 0, run
        acked.update(run["acked"])
        abandoned += run["abandoned"]

    async def check() -> tuple[set[str], set[str]]:
        client = await FleetClient.connect(fleet.url)
        try:
            for key in abandoned:  # an unknown outcome: asked again with the same key
                again = CreateRequest(region="mad", config=SLEEPER, skip_launch=True, idempotency_key=key)
                acked[key] = (await client.create("load", again)).id
            for machine_id in acked.values():
                await client.get("load", machine_id, events=False)
            return set(acked.values()), {m.id for m in await client.list("load")}
        finally:
            await client.close()

    ids, listed = arun(check())
    assert len(ids) == len(acked)  # one machine per idempotency key
    assert listed == ids  # every acknowledged create is there, and nothing else
    assert {r for r, _ in arun(_streams(fleet.url)).values()} == {3}


def test_a_process_told_another_layout_refuses_in_one_line_and_writes_nothing(fleet: DevFleet) -> None:
    before = arun(_streams(fleet.url))
    for args, env, said in (
        (["broker", "--name", "intruder"], {REPLICAS_ENV: "1"}, "R1 ($FAUXMAD_REPLICAS)"),
        (
            ["worker", "--region", "mad", "--worker-id", "intruder", "--data-dir", str(fleet.root / "intruder")],
            {SUPERCLUSTER_ENV: "mad,syd"},
            "regions mad,syd ($FAUXMAD_SUPERCLUSTER)",
        ),
    ):
        result = fauxmad(fleet, *args, env=env, timeout=60)
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1, result.stdout + result.stderr
        assert said in lines[0] and "one cluster, R3" in lines[0], lines[0]
    after = arun(_streams(fleet.url))
    assert set(after) == set(before)  # no stream made
    for name in (f"KV_{LAYOUT_BUCKET}", "KV_fauxmad_apps", "FAUXMAD_AUDIT"):
        assert after[name] == before[name], name  # nothing written

    async def intruder_key() -> list[str]:
        nc = await connect_nats(fleet.url)
        try:
            return [k for k in await kv_keys(await nc.jetstream().key_value("fauxmad_workers")) if "intruder" in k]
        finally:
            await nc.close()

    assert arun(intruder_key()) == []


@pytest.mark.fleet  # starts processes of its own
def test_an_r1_fleet_moves_to_r3_with_one_command_while_machines_and_jobs_run() -> None:
    _no_layout_variables()
    spec = FleetSpec(regions=["mad"], workers_per_region=1, cpus=64, memory_mb=8192, cluster=3, replicas=1)
    with DevFleet(spec, progress=print) as fleet:
        assert {r for r, _ in arun(_streams(fleet.url)).values()} == {1}

        async def start() -> list[str]:
            client = await FleetClient.connect(fleet.url)
            try:
                return [
                    (
                        await client.create(
                            "moving", CreateRequest(region="mad", config=SLEEPER, idempotency_key=f"m{i}")
                        )
                    ).id
                    for i in range(3)
                ]
            finally:
                await client.close()

        machines = arun(start())
        done = fauxmad(fleet, "job", "submit", "-a", "movejobs", "-r", "mad", "--wait", "--json", "--", "true")
        assert done.returncode == 0, done.stderr
        slow = fauxmad(fleet, "job", "submit", "-a", "movejobs", "-r", "mad", "--", "sleep", "4")
        assert slow.returncode == 0, slow.stderr
        slow_id = slow.stdout.strip()
        before = arun(_streams(fleet.url))

        moved = fauxmad(fleet, "fleet", "replicas", "3")
        assert moved.returncode == 0, moved.stdout + moved.stderr
        assert "R3" in moved.stdout
        listed_now = fauxmad(fleet, "workers", "--json")  # at once: the command waited for the workers' beats
        assert [w["worker_id"] for w in json.loads(listed_now.stdout)] == ["mad-w1"], listed_now.stdout
        after = arun(_streams(fleet.url))
        assert {name: r for name, (r, _) in after.items() if r != 3} == {}
        for name, (_, seq) in before.items():
            if name != "FAUXMAD_JOB_EVENTS":  # made again (async persistence cannot be replicated): notifications
                assert after[name][1] >= seq, name  # nothing lost
        shown = fauxmad(fleet, "fleet", "layout")
        assert "one cluster, R3" in shown.stdout

        waited = fauxmad(fleet, "job", "wait", slow_id, "-a", "movejobs", "--timeout", "30")
        assert waited.returncode == 0, waited.stdout + waited.stderr
        listed = fauxmad(fleet, "machine", "list", "-a", "moving", "--json")
        assert listed.returncode == 0, listed.stderr
        assert {m["id"]: m["state"] for m in json.loads(listed.stdout)} == {m: "started" for m in machines}
        after_job = fauxmad(fleet, "job", "submit", "-a", "movejobs", "-r", "mad", "--wait", "--", "true")
        assert after_job.returncode == 0, after_job.stderr
        wait_until(lambda: fauxmad(fleet, "workers", "--json").stdout.count("worker_id") == 1, "the worker listed", 10)
        arun(_heard_only_after_the_freeze(fleet))


async def _heard_only_after_the_freeze(fleet: DevFleet) -> None:
    """What `fleet replicas` waits with after a move: a worker silent past a TTL (frozen, as one whose beats
    cannot be stored) counts as heard only by a beat after it thaws, and one still frozen is named."""
    pid = next(p.pid for name, p in fleet.processes if name == "worker-mad-w1")
    client = await FleetClient.connect(fleet.url)
    try:
        before = await live_workers(client)
        assert before is not None and set(before) == {"mad-w1"}
        os.kill(pid, signal.SIGSTOP)
        try:
            assert await heard_again(client, before, within=1.0) == ["mad-w1"]
            asyncio.get_running_loop().call_later(WORKER_TTL + 1, os.kill, pid, signal.SIGCONT)
            waiting = asyncio.ensure_future(heard_again(client, before, within=30.0))
            await asyncio.sleep(WORKER_TTL + 0.5)
            assert not waiting.done()  # frozen past a TTL: not heard, still waiting
            assert await waiting == []
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        await client.close()
