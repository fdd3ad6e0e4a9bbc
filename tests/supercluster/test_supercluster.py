"""A loopback supercluster (3 regions x 3 nats-servers, R3 inside each region) with workers, a broker and an
operator per region, each connected to its own region: deploys, a server killed under load, a region cut off.

One fleet for the module (it takes a while to start on a small machine). The cut is a real TCP partition of
the region's gateways (`bus.local.gateway_relay`): its routes and clients stay up. Both cuts run in CI: `syd` for a
few seconds, then the issue's 30-second cut (of `gru`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.errors import BucketNotFoundError

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, Machine, MachineConfig
from bus.transport.connection import servers
from bus.transport.fleet_layout import LayoutConflict
from bus.transport.jetstream import FleetConfig, ensure_fleet_resources
from bus.transport.layout import REPLICAS_ENV, SUPERCLUSTER_ENV, Layout
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, audit_records, connect_nats, wait_until
from tests.orchestrator.reconcile.test_reconcile import fauxmad, machines, primaries, spares, write_spec

REGIONS = ["mad", "syd", "gru"]

CI_CUT_SECONDS = 6.0
# How long a deploy here waits for a machine to pass its check. Nine nats-servers and a dozen fauxmad processes
# share the test machine's cores, so the app's interpreter may take seconds to listen, most of all right after a
# test made a region elect its leaders again (CI once saw 6 s go by). What these tests show is placement and
# failover, not how fast the app starts.
DEPLOY_WAIT = "30s"


@pytest.fixture(scope="module")
def fleet() -> Iterator[DevFleet]:
    spec = FleetSpec(
        regions=REGIONS, workers_per_region=2, cpus=512, memory_mb=65536, supercluster=3, operators=True, heartbeat=0.5
    )
    with DevFleet(spec, progress=print) as running:
        yield running


def in_region(fleet: DevFleet, region: str, fn: object) -> object:
    """Run `fn(client)` with a client connected to `region`'s own servers."""

    async def go() -> object:
        client = await FleetClient.connect(fleet.region_url(region))
        try:
            return await fn(client)  # type: ignore[operator]
        finally:
            await client.close()

    return arun(go())


def started(found: list[Machine]) -> dict[str, list[tuple[str, str]]]:
    """Started primaries by region: (machine id, worker id)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for m in primaries(found):
        if m.state == "started":
            out.setdefault(m.region, []).append((m.id, m.worker_id))
    return {region: sorted(ids) for region, ids in out.items()}


def test_every_process_connects_to_its_own_region_and_the_cli_reaches_every_region(fleet: DevFleet) -> None:
    assert fleet.supercluster is not None
    for name, args in fleet.commands.items():
        if "--region" in args:
            region = args[args.index("--region") + 1]
            assert args[args.index("--nats") + 1] == fleet.region_url(region), name
    sleep = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=32))

    async def from_syd(client: FleetClient) -> list[Machine]:
        return [await client.create("reach", CreateRequest(region=r, config=sleep, skip_launch=True)) for r in REGIONS]

    placed = in_region(fleet, "syd", from_syd)
    assert [m.region for m in placed] == REGIONS  # type: ignore[attr-defined]
    assert all(m.worker_id.startswith(m.region) for m in placed)  # type: ignore[attr-defined]
    regions = in_region(fleet, "gru", lambda c: c.regions())
    assert {r.region: (r.workers, r.reachable) for r in regions} == {r: (2, True) for r in REGIONS}  # type: ignore[attr-defined]

    async def creates_audited() -> int:  # each region's worker sends its create's record to the audit stream at home
        nc = await connect_nats(fleet.url)
        try:
            return len([r for r in await audit_records(nc, "reach") if ".machines.create" in r.path])
        finally:
            await nc.close()

    wait_until(lambda: arun(creates_audited()) >= 3, "every region's create in the fleet's audit stream", 30.0)
    assert arun(creates_audited()) == 3


def test_a_region_s_state_lives_in_its_own_cluster(fleet: DevFleet) -> None:
    async def go() -> dict[str, tuple[str, int]]:
        nc = await connect_nats(fleet.url)
        try:
            js = nc.jetstream()
            out = {}
            for region in REGIONS:
                for name in (
                    f"KV_fauxmad_workers_{region}",
                    f"KV_fauxmad_machines_{region}",
                    f"FAUXMAD_EVENTS_{region}",
                ):
                    info = await js.stream_info(name)
                    assert info.cluster is not None
                    out[name] = (info.cluster.name, info.config.num_replicas)
            fleet_events = await js.stream_info("FAUXMAD_EVENTS")
            assert {s.name for s in fleet_events.config.sources or []} == {f"FAUXMAD_EVENTS_{r}" for r in REGIONS}
            return out
        finally:
            await nc.close()

    placed = arun(go())
    for name, (cluster, replicas) in placed.items():
        assert name.endswith(cluster) and replicas == 3, (name, cluster, replicas)


def test_a_process_told_nothing_follows_the_fleet_s_layout_and_one_told_otherwise_refuses(
    fleet: DevFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SUPERCLUSTER_ENV)
    monkeypatch.delenv(REPLICAS_ENV)

    async def go() -> tuple[Layout, str]:
        nc = await connect_nats(fleet.url)
        try:
            followed = (await ensure_fleet_resources(nc.jetstream())).layout  # the fleet's, from KV fauxmad_layout
            other = await connect_nats(fleet.url)
            try:
                with pytest.raises(LayoutConflict) as caught:
                    await ensure_fleet_resources(other.jetstream(), FleetConfig(layout=Layout()))  # told: one server
                with pytest.raises(BucketNotFoundError):
                    await other.jetstream().key_value("fauxmad_workers")  # nothing was created on the way
            finally:
                await other.close()
            return followed, caught.value.message
        finally:
            await nc.close()

    followed, refusal = arun(go())
    assert followed == Layout(regions=tuple(REGIONS), replicas=3)
    assert "told no regions and R1 (its configuration)" in refusal and "regions mad,syd,gru (home mad), R3" in refusal


def test_deploy_across_three_regions(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "fauxmad.toml", "three", regions="mad = 1\nsyd = 1\ngru = 1", spares=1, wait=DEPLOY_WAIT
    )
    result = fauxmad(fleet, "deploy", "-c", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    found = machines(fleet, "three")
    assert {r: len(ids) for r, ids in started(found).items()} == {"mad": 1, "syd": 1, "gru": 1}


async def _leader(fleet: DevFleet, stream: str) -> str:
    nc = await connect_nats(fleet.url)
    try:
        info = await nc.jetstream().stream_info(stream)
        assert info.cluster is not None and info.cluster.leader is not None
        return info.cluster.leader
    finally:
        await nc.close()


async def _region_healthy(fleet: DevFleet, region: str, timeout: float) -> float:
    """Wait until every stream of `region` has a leader and all its replicas are current (a server killed and
    restarted has caught up); return how long that took. The next test then starts on a whole fleet."""
    layout = Layout(regions=tuple(REGIONS))
    streams = [
        f"KV_{layout.workers_bucket(region)}",
        f"KV_{layout.machines_bucket(region)}",
        f"KV_{layout.idempotency_bucket(region)}",
        f"FAUXMAD_EVENTS_{region}",
    ]
    nc = await connect_nats(fleet.url)
    started_at = time.perf_counter()
    try:
        js = nc.jetstream(timeout=1.0)
        pending = list(streams)
        while pending:
            try:
                info = await js.stream_info(pending[0])
                cluster = info.cluster
                if (
                    cluster is not None
                    and cluster.leader
                    and all(p.current and not p.offline for p in cluster.replicas or [])
                ):
                    pending.pop(0)
                    continue
            except Exception:  # no leader yet: the request times out or is refused
                pass
            assert time.perf_counter() - started_at < timeout, (
                f"{region}'s streams not whole after {timeout}s: {pending}"
            )
            await asyncio.sleep(0.2)
        return time.perf_counter() - started_at
    finally:
        await nc.close()


PACE = 0.05  # seconds between one creator's creates: 4 creators, 6 s, at most ~480 of syd's 1,024 cpus


def test_kill_9_of_one_server_under_create_load_loses_no_acknowledged_create(fleet: DevFleet) -> None:
    assert fleet.supercluster is not None
    sc = fleet.supercluster
    victim = arun(_leader(fleet, "KV_fauxmad_machines_syd"))  # the server leading syd's routing index
    # the region's own URLs (tls:// on a secure fleet): the victim's is the one with its port
    (victim_url,) = [u for u in servers(fleet.region_url("syd")) if u.endswith(f":{sc.server(victim).port}")]
    others = [u for u in servers(fleet.region_url("syd")) if u != victim_url]
    config = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=16))
    acked: dict[str, str] = {}  # idempotency key -> machine id
    abandoned: list[str] = []  # keys whose 20 tries all failed: their create may or may not have happened
    failures: dict[str, int] = {}
    times: dict[str, float] = {}

    async def load() -> None:
        async def reconnected() -> None:
            times.setdefault("reconnected", time.perf_counter())

        watcher = await connect_nats(
            ",".join([victim_url, *others]),
            dont_randomize=True,
            reconnect_time_wait=0.25,
            max_reconnect_attempts=-1,
            reconnected_cb=reconnected,
        )
        client = await FleetClient.connect(fleet.region_url("syd"))
        stop = time.perf_counter() + 6.0

        async def creator(n: int) -> None:
            i = 0
            while time.perf_counter() < stop:
                key = f"load-{n}-{i}"
                # the same key until it is acknowledged (never a second machine), for as long as a client would
                # wait out the election of a new leader for syd's streams (nats-server's raft: 4-9 s after a kill)
                give_up = time.perf_counter() + 30.0
                while True:
                    try:
                        m = await client.create(
                            "load", CreateRequest(region="syd", config=config, skip_launch=True, idempotency_key=key)
                        )
                        acked[key] = m.id
                        await asyncio.sleep(PACE)  # a load across the kill, not a race to fill syd's cpus
                        break
                    except Exception as exc:
                        why = f"{type(exc).__name__}: {str(exc)[:80]}"
                        failures[why] = failures.get(why, 0) + 1
                        if time.perf_counter() > give_up:
                            abandoned.append(key)
                            break
                        await asyncio.sleep(0.1)
                i += 1

        async def killer() -> None:
            # the create load runs before the kill, so the kill lands under load
            await asyncio.sleep(2.0)
            times["killed"] = time.perf_counter()
            await asyncio.to_thread(sc.kill, victim)

        try:
            await asyncio.gather(killer(), *(creator(n) for n in range(4)))
        finally:
            await client.close()
            await watcher.close()

    arun(load())
    sc.restart(victim)
    reconnect = times["reconnected"] - times["killed"]
    healed = arun(_region_healthy(fleet, "syd", 60.0))
    print(
        f"\nkilled {victim}: {len(acked)} creates acknowledged, {len(abandoned)} keys given up after 30 s; "
        f"client reconnect {reconnect:.2f}s; syd's streams whole again {healed:.1f}s after the restart; "
        f"failed attempts: {failures}"
    )

    async def check() -> tuple[set[str], list[Machine]]:
        # the others' URLs: a client of the server just restarted may find no broker for a moment (its routes'
        # interest is still arriving), which says nothing about what was stored
        client = await FleetClient.connect(",".join(others))
        try:
            for key in abandoned:  # what a client does with an unknown outcome: ask again with the same key
                again = CreateRequest(region="syd", config=config, skip_launch=True, idempotency_key=key)
                acked[key] = (await client.create("load", again)).id
            for machine_id in acked.values():
                await client.get("load", machine_id, events=False)  # found through the (R3) routing index
            return set(acked.values()), await client.list("load")
        finally:
            await client.close()

    ids, listed = arun(check())
    assert len(ids) == len(acked)  # one machine per key
    assert {m.id for m in listed} == ids  # every acknowledged create is there, and nothing else


def test_a_region_that_lost_its_quorum_stops_no_deploy_elsewhere(fleet: DevFleet, tmp_path: Path) -> None:
    """Two of syd's three servers down: syd's streams have no leader (and get none) until one comes back. A
    deploy of an app in mad starts anyway (its CLI binds syd's buckets unseen, after a short wait) and places."""
    assert fleet.supercluster is not None
    sc = fleet.supercluster
    down = ["syd-1", "syd-2"]
    for name in down:
        sc.kill(name)
    try:
        spec = write_spec(tmp_path / "fauxmad.toml", "elsewhere", regions="mad = 1", spares=0, wait=DEPLOY_WAIT)
        began = time.perf_counter()
        result = fauxmad(fleet, "deploy", "-c", str(spec))
        took = time.perf_counter() - began
        assert result.returncode == 0, result.stdout + result.stderr
        assert set(started(machines(fleet, "elsewhere"))) == {"mad"}
    finally:
        for name in down:
            sc.restart(name)
        healed = arun(_region_healthy(fleet, "syd", 90.0))
    print(
        f"\na deploy in mad with syd's quorum lost took {took:.1f}s; syd whole again {healed:.1f}s after the restarts"
    )


def _operator_passes(fleet: DevFleet, nudge: str, region: str) -> None:
    """Show `region`'s operator alive and stepping every app, after the heal: destroy its machine of `nudge` and
    wait for the operator to replace it, twice. The second replacement comes from a pass that began after the pass
    that made the first had stepped every app (the cut app included): anything it would move, it has moved."""
    alive = [name for name, proc in fleet.processes if proc.poll() is None]
    assert f"operator-{region}" in alive, f"operator-{region} is not running: {alive}"
    for _ in range(2):
        (gone,) = [m for m in machines(fleet, nudge) if m.region == region and m.state == "started"]
        in_region(fleet, region, lambda c: c.destroy(nudge, gone.id, force=True))  # noqa: B023

        def replaced() -> bool:
            now = [m for m in machines(fleet, nudge) if m.region == region and m.state == "started"]
            return bool(now) and all(m.id != gone.id for m in now)  # noqa: B023

        wait_until(replaced, f"operator-{region} to replace {nudge}'s machine after the heal", 30)


def _partition(fleet: DevFleet, tmp_path: Path, app: str, region: str, cut_seconds: float, regions: list[str]) -> None:
    """Run `app` in `regions`; cut `region` off for `cut_seconds` while it places and fails over inside."""
    assert fleet.supercluster is not None
    counts = "\n".join(f"{r} = 1" for r in regions)
    spec = write_spec(tmp_path / "fauxmad.toml", app, regions=counts, spares=1, wait=DEPLOY_WAIT)
    result = fauxmad(fleet, "deploy", "-c", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    outside = [r for r in regions if r != region]
    # the other regions' operators are shown alive and looking after the heal by replacing this app's machines
    nudge = f"{app}-nudge"
    nudge_counts = "\n".join(f"{r} = 1" for r in outside)
    nudge_spec = write_spec(tmp_path / "nudge.toml", nudge, regions=nudge_counts, spares=0, wait=DEPLOY_WAIT)
    result = fauxmad(fleet, "deploy", "-c", str(nudge_spec))
    assert result.returncode == 0, result.stdout + result.stderr
    wait_until(lambda: len(spares(machines(fleet, app))) == len(regions), "a spare per region", 30)
    before = started(machines(fleet, app))
    ((primary, worker),) = before[region]
    sleep = MachineConfig(cmd=["sleep", "60"], guest=Guest(cpus=1, memory_mb=16))

    fleet.supercluster.cut(region)
    cut_at = time.perf_counter()
    # the others see it as unreachable (not as empty), and keep their own machines as they were
    wait_until(
        lambda: not {r.region: r.reachable for r in in_region(fleet, outside[0], lambda c: c.regions())}[region],
        f"{outside[0]} to see {region} unreachable",
        # type: ignore[attr-defined]
        15,
    )
    # inside, it keeps placing...
    placed = in_region(fleet, region, lambda c: c.create("inside", CreateRequest(region=region, config=sleep)))
    assert placed.region == region and placed.state in ("created", "starting", "started")  # type: ignore[attr-defined]
    # ...and failing over: its primary's host dies, its own operator starts the spare on another worker
    fleet.kill_host(worker)

    def failed_over() -> bool:
        found = in_region(fleet, region, lambda c: c.list(app))
        now = started([m for m in found if m.region == region])  # type: ignore[union-attr]
        return bool(now.get(region)) and now[region][0][1] != worker

    killed = time.monotonic()
    try:
        wait_until(failed_over, f"{region}'s operator to fail over inside the cut", 30)
    except AssertionError:
        print((fleet.root / "logs" / f"operator-{region}.log").read_text()[-5000:])
        print((fleet.root / "logs" / f"broker-{region}-1.log").read_text()[-3000:])
        raise
    print(f"\n{region} failed over inside the cut in {time.monotonic() - killed:.1f}s after its primary's host died")
    during = started([m for m in in_region(fleet, region, lambda c: c.list(app)) if m.region == region])  # type: ignore[union-attr]
    time.sleep(max(0.0, cut_seconds - (time.perf_counter() - cut_at)))
    fleet.supercluster.heal(region)

    wait_until(
        lambda: {r.region: r.reachable for r in in_region(fleet, outside[0], lambda c: c.regions())}[region],
        f"{outside[0]} to see {region} again",
        # type: ignore[attr-defined]
        30,
    )
    for other in outside:  # every other operator makes whole passes after the heal: see `_operator_passes`
        _operator_passes(fleet, nudge, other)
    after = started(machines(fleet, app))
    assert after[region] == during[region] and after[region][0][0] != primary  # the failover inside, and only it
    for other in outside:
        assert after[other] == before[other]  # nothing moved outside the cut region
    assert sum(len(ids) for ids in after.values()) == len(regions)  # one started copy per instance
    for other in outside:  # the other regions' operators never acted on the cut region
        log = (fleet.root / "logs" / f"operator-{other}.log").read_text()
        assert f"{app} {region}:" not in log, log[-2000:]


def test_a_region_cut_off_keeps_placing_and_failing_over_and_nothing_moves_after_the_heal(
    fleet: DevFleet, tmp_path: Path
) -> None:
    _partition(fleet, tmp_path, "cut", "syd", CI_CUT_SECONDS, REGIONS)


def test_a_region_cut_off_for_30_seconds(fleet: DevFleet, tmp_path: Path) -> None:
    # syd lost a host in the test before: this app runs where two workers are left for a primary and its spare
    _partition(fleet, tmp_path, "cut30", "gru", 30.0, ["mad", "gru"])
