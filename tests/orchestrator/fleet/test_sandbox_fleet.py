"""A sandboxed machine through the whole path: CLI -> broker -> auction -> worker -> launcher -> bwrap.

Real nats-server, real worker and broker processes. The machine runs a web server inside its sandbox
and is reached on the host's network; `machine exec` runs inside the sandbox; a bad `--sandbox` is one
line and exit 2.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import fleet_fixture
from tests.orchestrator.cli.test_cli import fauxmad
from workers.driver import sandbox

pytestmark = pytest.mark.skipif(
    sandbox.bwrap_path() is None, reason="bubblewrap is not installed (Debian: apt-get install bubblewrap)"
)


fleet = fleet_fixture(FleetSpec(regions=["ams"], workers_per_region=2, cpus=2, memory_mb=2048))


def test_a_sandboxed_machine_serves_on_the_host_network_and_exec_enters_it(fleet: DevFleet) -> None:
    server = 'exec python3 -m http.server --bind 127.0.0.1 "$PORT"'
    run = fauxmad(
        *("machine", "run", "-a", "boxed", "-r", "ams", "--sandbox", "bwrap", "--json", "--nats", fleet.url),
        *("--", "sh", "-c", server),
    )
    assert run.returncode == 0, run.stderr
    machine = json.loads(run.stdout)
    assert machine["config"]["guest"]["sandbox"] == "bwrap"
    port = machine["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:  # the host's network
        assert response.status == 200

    inside = fauxmad(
        *("machine", "exec", machine["id"], "-a", "boxed", "--nats", fleet.url),
        *("--", "sh", "-c", "hostname; ls /proc | grep -c '^[0-9]'"),
    )
    assert inside.returncode == 0, inside.stderr
    hostname, processes = inside.stdout.split()
    assert hostname == machine["id"]
    assert int(processes) <= 8  # the machine's and the exec's own: never the host's
    destroyed = fauxmad("machine", "destroy", machine["id"], "-a", "boxed", "--force", "--nats", fleet.url)
    assert destroyed.returncode == 0, destroyed.stderr


def test_a_bad_sandbox_is_one_line_and_exit_2(fleet: DevFleet) -> None:
    bad = fauxmad(
        "machine", "run", "-a", "boxed", "-r", "ams", "--sandbox", "docker", "--nats", fleet.url, "--", "true"
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "sandbox" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_readme_guest_block_is_a_valid_sandboxed_guest() -> None:
    import re
    import tomllib

    import msgspec

    from bus.contract.machines import Guest
    from tests.helpers import ROOT

    section = (
        (ROOT / "docs" / "tutorials" / "images-and-volumes.md")
        .read_text()
        .split("## Sandboxes", 1)[1]
        .split("\n## ", 1)[0]
    )
    [block] = re.findall(r"```toml\n(.*?)```", section, re.S)
    guest = msgspec.convert(tomllib.loads(block)["guest"], Guest)
    assert guest.sandbox == "bwrap"
