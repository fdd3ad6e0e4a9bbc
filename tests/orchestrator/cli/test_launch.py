"""`fauxmad launch` on the three samples in `examples/launch/` (Python, Node, static), each deployed with
`--deploy` on a real dev fleet and answering through a real `fauxmad proxy`; and what launch says of a
directory it cannot tell. The Node sample needs `node` on the machine (skipped, saying so, without it).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests import helpers
from tests.helpers import arun, fleet_fixture
from tests.orchestrator import proxy_kit as kit

pytestmark = pytest.mark.fleet  # starts a fleet of real processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = ROOT / "examples" / "launch"
REGION = "lch"


fleet = fleet_fixture(FleetSpec(regions=[REGION], workers_per_region=2, cpus=8, memory_mb=8192))


@pytest.fixture(scope="module")
def proxy(fleet: DevFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.ProxyProcess]:
    running = kit.ProxyProcess(fleet.url, REGION, tmp_path_factory.mktemp("proxy"))
    yield running
    running.stop()


def fauxmad(fleet: DevFleet, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return helpers.fauxmad(*args, url=fleet.url, cwd=cwd, timeout=180)


def through_proxy(proxy: kit.ProxyProcess, app: str, deadline: float = 15.0) -> kit.Response:
    """The app's answer to `GET /` through the edge proxy (which learns of a release from its KV watch)."""
    end = time.monotonic() + deadline
    while True:
        response = arun(kit.get(proxy.port, f"{app}.localhost"))
        if response.status == 200 or time.monotonic() > end:
            return response
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("sample", "kind", "expect"),
    [
        ("python", "python", b'"sample": "python"'),
        ("node", "node", b'"sample":"node"'),
        ("static", "static", b"static sample"),
    ],
)
def test_launch_deploys_each_sample_and_it_answers_through_the_proxy(
    fleet: DevFleet,
    proxy: kit.ProxyProcess,
    tmp_path: Path,
    unique: Callable[[str], str],
    sample: str,
    kind: str,
    expect: bytes,
) -> None:
    if sample == "node" and shutil.which("node") is None:
        pytest.skip("node is not installed on this machine: the Node sample cannot run (apt-get install nodejs)")
    directory = tmp_path / sample
    shutil.copytree(SAMPLES / sample, directory)  # launch writes fauxmad.toml into the directory
    app = unique(f"launch-{sample}")
    launched = fauxmad(fleet, "launch", str(directory), "--name", app, "--region", REGION, "--deploy")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    assert f"{kind} (" in launched.stdout and f"wrote {directory / 'fauxmad.toml'}" in launched.stdout
    spec = (directory / "fauxmad.toml").read_text()
    assert f'app = "{app}"' in spec and "[http_service]" in spec and f"{REGION} = 1" in spec
    response = through_proxy(proxy, app)
    assert response.status == 200 and expect in response.body, response.body[:300]
    assert fauxmad(fleet, "apps", "destroy", app, "--yes").returncode == 0


def test_launch_says_what_it_cannot_tell_and_takes_a_command(fleet: DevFleet, tmp_path: Path) -> None:
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "notes.txt").write_text("nothing to run\n")
    refused = fauxmad(fleet, "launch", str(unknown), "--region", REGION)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "cannot tell what" in refused.stderr and "--cmd" in refused.stderr
    assert not (unknown / "fauxmad.toml").exists()

    given = fauxmad(
        fleet, "launch", str(unknown), "--region", REGION, "--cmd", "python3 -m http.server $PORT", "--json"
    )
    assert given.returncode == 0, given.stderr
    spec = (unknown / "fauxmad.toml").read_text()
    assert 'cmd = ["sh", "-c", "exec python3 -m http.server $PORT"]' in spec
    assert f'app = "{unknown.name}"' in spec  # the directory's name

    again = fauxmad(fleet, "launch", str(unknown), "--region", REGION, "--cmd", "true")
    assert again.returncode == 2 and "exists: pass --force" in again.stderr

    defaulted = tmp_path / "py"
    shutil.copytree(SAMPLES / "python", defaulted)
    chosen = fauxmad(fleet, "launch", str(defaulted), "--name", "launchdefault")  # no --region: the fleet's
    assert chosen.returncode == 0, chosen.stderr
    assert f"{REGION} = 1" in (defaulted / "fauxmad.toml").read_text() and "next: fauxmad deploy -c" in chosen.stdout
    assert fauxmad(fleet, "launch", str(tmp_path / "missing"), "--region", REGION).returncode == 2
