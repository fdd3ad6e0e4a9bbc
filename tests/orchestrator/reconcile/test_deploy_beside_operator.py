"""A deploy with the operator running: the app is the deploy's until it ends, so the two never plan it at once.

Found by the nemesis on hosts (seed 101, a supercluster with an operator per region): `fauxmad deploy` of a new app
and the operators raced. Both saw a region short of its primary and both created one; then both saw one too many
and each destroyed the copy the other had made, so the region had none for a moment, before any fault struck.
Now a deploy claims the app (`<app>.deploying`, `rollout.deploying`) before it points the app at the release,
and the operators leave a claimed app alone until the claim goes.

The race itself needs the operator to look between the deploy's pointing and its creates becoming visible: on
hosts with their own latency it did; on one host, four deploys beside the operator did not show it. So the first
test holds a deploy's place by hand: a release pointed at under a claim, as `deploy` leaves it in the moment
before it converges. The operator must leave the app alone while the claim holds (it acted at once before) and
converge it once the claim goes. Then `fauxmad deploy` beside the operator, and nothing it placed destroyed.

Real parts: a dev fleet (nats-server, four workers in two regions, a broker) with `fauxmad reconcile --watch`
running as a subprocess; the release and the claim are written in KV `fauxmad_apps` as a deploy writes them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bus.contract.machines import Machine
from bus.transport.connection import connect
from bus.transport.jetstream import ensure_fleet_resources
from orchestrator.apps.releases import Releases
from orchestrator.apps.spec import load_spec
from orchestrator.apps.store import KVReleaseStore
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import arun, fleet_fixture, wait_until
from tests.orchestrator.reconcile.test_reconcile import fauxmad, primaries, spares, write_spec

COUNTS = {"mad": 2, "syd": 2}
REGIONS = "\n".join(f"{r} = {n}" for r, n in COUNTS.items())
WANTED = sum(COUNTS.values())
HOLDER = "a deploy in another process"
LOOK = 6.0  # seconds the operator is given to act on a claimed app: more than its backstop (5 s)


fleet = fleet_fixture(
    FleetSpec(regions=list(COUNTS), workers_per_region=2, cpus=8, memory_mb=4096, brokers=1, operators=True)
)


def ever(fleet: DevFleet, app: str) -> list[Machine]:
    """Every machine the workers made for `app`, destroyed ones included."""

    async def go() -> list[Machine]:
        client = await FleetClient.connect(fleet.url)
        try:
            return await client.list(app)
        finally:
            await client.close()

    return arun(go())


def releases_do(fleet: DevFleet, what: str, spec_path: Path | None = None) -> None:
    """`begin` by hand (a release, the claim, then `current`), or `unclaim`: what a deploy writes."""

    async def go() -> None:
        nc = await connect(fleet.url, "deploy-beside-operator")
        try:
            kv = await ensure_fleet_resources(nc.jetstream())
            releases = Releases(KVReleaseStore(kv.apps))
            if what == "begin":
                assert spec_path is not None
                spec = load_spec(spec_path)
                release = await releases.create(spec, "deploy (by hand)")
                # the claim as `rollout.deploying` writes it (written raw, so the test runs on a tree without it)
                claim = {"app": spec.app, "holder": HOLDER, "release": release.version, "until": time.time() + 120}
                await kv.apps.put(f"{spec.app}.deploying", json.dumps(claim).encode())
                await releases.point(spec.app, release.version)
            else:
                await kv.apps.purge("held.deploying")
        finally:
            await nc.close()

    arun(go())


def test_the_operator_leaves_a_claimed_app_to_its_deploy_and_takes_it_up_when_the_claim_goes(
    fleet: DevFleet, tmp_path: Path
) -> None:
    spec = write_spec(tmp_path / "held.toml", "held", regions=REGIONS, spares=1, wait="20s")
    releases_do(fleet, "begin", spec)
    time.sleep(LOOK)
    assert ever(fleet, "held") == [], "the operator acted on an app a deploy held"

    releases_do(fleet, "unclaim")

    def converged() -> bool:
        alive = [m for m in ever(fleet, "held") if m.state != "destroyed"]
        return len(primaries(alive)) == WANTED and len(spares(alive)) == WANTED

    wait_until(converged, "the operator to converge the app once the claim went", 60)


def test_a_deploy_beside_the_operator_destroys_nothing(fleet: DevFleet, tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "beside.toml", "beside", regions=REGIONS, spares=1, wait="20s")
    done = fauxmad(fleet, "deploy", "-c", str(spec), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"], done.stdout

    def settled() -> bool:
        alive = [m for m in ever(fleet, "beside") if m.state != "destroyed"]
        return len(primaries(alive)) == WANTED and len(spares(alive)) == WANTED

    wait_until(settled, "the primaries and the spares", 60)  # the operator makes the spares after the deploy
    found = ever(fleet, "beside")
    gone = [f"{m.id} ({m.region})" for m in found if m.state in ("destroying", "destroyed")]
    assert not gone, f"machines destroyed while the deploy and the operator placed the app: {gone}"
    assert len(found) == 2 * WANTED, f"{len(found)} machines made for {WANTED} primaries and {WANTED} spares"
