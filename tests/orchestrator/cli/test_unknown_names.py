"""One answer for a name the fleet does not know (docs/reference/exit-codes.md, "Unknown names"; issue 41).

A table: every command taking `--app`, `--region` or a machine id, given a name the fleet does not know,
exits 4 with one line on stderr, suggesting the closest name when one is near (`sandwhich` -> `sandwich`);
an unknown region lists the regions there are; region names ignore case; a machine id may be a unique
prefix. And "the apps" are one set: `apps list` shows an app made by `machine run`. `image ls` is a table
with a header and sizes people read, `image inspect` says when in ISO 8601. Real processes against one dev
fleet for the module.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bus.contract.fleet import CreateRequest
from bus.contract.machines import Guest, MachineConfig
from orchestrator.cli.image_cmd import human_size
from orchestrator.client import FleetClient
from orchestrator.devfleet import DevFleet, FleetSpec
from tests.helpers import ROOT, arun
from tests.orchestrator.cli.test_output_fits import _env

pytestmark = pytest.mark.fleet

APP = "sandwich"
NEAR_APP = "sandwhich"  # a typo: suggested
FAR_APP = "zzqx"  # nothing near: no suggestion
REGIONS = "the regions are mad, syd"


def fauxmad(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        env=_env(url),
        timeout=120,
        cwd=str(ROOT),
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, str]]:
    """The fleet's URL, and the id of app sandwich's one machine (in mad)."""
    spec = FleetSpec(regions=["mad", "syd"], workers_per_region=1, cpus=24, memory_mb=4096)  # room for 18 in mad
    with DevFleet(spec) as running:
        made = fauxmad(running.url, "machine", "run", "--app", APP, "--region", "MAD", "--json", "--", "sleep", "600")
        assert made.returncode == 0, made.stderr  # MAD is mad
        yield running.url, json.loads(made.stdout)["id"]


def app_commands(app: str, mid: str) -> list[list[str]]:
    """Every command that takes --app (or an app argument), with `app` in it."""
    return [
        ["status", "--app", app],
        ["events", "--app", app],
        ["releases", "--app", app],
        ["logs", "--app", app],
        ["machine", "list", "--app", app],
        ["machine", "show", mid, "--app", app],
        ["machine", "stop", mid, "--app", app],
        ["machine", "destroy", mid, "--app", app],
        ["machine", "logs", mid, "--app", app],
        ["machine", "explain", mid, "--app", app],
        ["scale", "count", "2", "--app", app],
        ["rollback", "--app", app],
        ["apps", "destroy", app, "--yes"],
    ]


def region_commands(region: str) -> list[list[str]]:
    """Every command that takes --region, with `region` in it."""
    return [
        ["machine", "run", "--app", "fresh", "--region", region, "--", "true"],
        ["workers", "--region", region],
        ["logs", "--app", APP, "--region", region],
        ["scale", "count", "2", "--app", APP, "--region", region],
    ]


def one_line_not_found(result: subprocess.CompletedProcess[str], *said: str) -> None:
    assert result.returncode == 4, (result.args[3:], result.returncode, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    for part in said:
        assert part in result.stderr, (result.args[3:], result.stderr)


def test_an_unknown_app_is_exit_4_on_every_command_with_the_closest_name(fleet: tuple[str, str]) -> None:
    url, mid = fleet
    for argv in app_commands(NEAR_APP, mid):
        one_line_not_found(fauxmad(url, *argv), f"no app '{NEAR_APP}' (did you mean '{APP}'?)")
    for argv in app_commands(FAR_APP, mid)[:5]:
        result = fauxmad(url, *argv)
        one_line_not_found(result, f"no app '{FAR_APP}'", "fauxmad apps list")
        assert "did you mean" not in result.stderr


def test_an_unknown_region_is_exit_4_listing_the_regions(fleet: tuple[str, str]) -> None:
    url, _ = fleet
    for argv in region_commands("sdy"):
        one_line_not_found(fauxmad(url, *argv), "no region 'sdy' (did you mean 'syd'?)", REGIONS)
    for argv in region_commands("lhr"):
        result = fauxmad(url, *argv)
        one_line_not_found(result, "no region 'lhr'", REGIONS)
        assert "did you mean" not in result.stderr
    listed = fauxmad(url, "workers", "--region", "SYD", "--json")
    assert listed.returncode == 0 and {w["region"] for w in json.loads(listed.stdout)} == {"syd"}


def test_a_machine_id_is_whole_or_a_unique_prefix(fleet: tuple[str, str]) -> None:
    url, mid = fleet
    shown = fauxmad(url, "machine", "show", mid[:6], "--app", APP, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == mid
    typo = mid[:-1] + ("0" if mid[-1] != "0" else "1")
    for verb in ("show", "stop", "logs"):
        one_line_not_found(
            fauxmad(url, "machine", verb, typo, "--app", APP), f"{typo}", "not found", f"did you mean '{mid}'"
        )
    other = "f" if not mid.startswith("f") else "0"
    one_line_not_found(fauxmad(url, "machine", "show", other, "--app", APP), f"machine {other} not found in app {APP}")


def test_an_ambiguous_machine_id_prefix_is_exit_2_naming_the_candidates(fleet: tuple[str, str]) -> None:
    """Machines of one app until two ids share their first digit (at most 17: one of 16 digits must repeat);
    that digit as the id: exit 2 (a usage error: the id is the user's to make longer), one line, both ids."""
    url, _ = fleet
    by_digit = arun(_twins(url))
    digit, twins = next((d, ids) for d, ids in by_digit.items() if len(ids) == 2)
    for verb in ("show", "stop", "logs"):
        result = fauxmad(url, "machine", verb, digit, "--app", "twins")
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, (verb, result.stderr)
        assert f"machine id '{digit}' is ambiguous in app twins" in result.stderr, result.stderr
        assert all(mid in result.stderr for mid in twins), result.stderr
    longer = twins[0][: next(i for i in range(1, 15) if twins[0][:i] != twins[1][:i])]
    shown = fauxmad(url, "machine", "show", longer, "--app", "twins", "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["id"] == twins[0], shown.stderr
    arun(_destroy(url, "twins", [mid for ids in by_digit.values() for mid in ids]))


TWIN = MachineConfig(cmd=["sleep", "600"], guest=Guest(memory_mb=16))


async def _twins(url: str) -> dict[str, list[str]]:
    """Machines of app twins (as `machine run --app twins --memory-mb 16 -- sleep 600` makes them) until two ids
    share their first digit, by first digit; made in this process (a CLI process each was 1.3 s of the test's
    time, and what is tested is the commands given the prefix, below)."""
    client = await FleetClient.connect(url)
    try:
        by_digit: dict[str, list[str]] = {}
        for _ in range(17):
            mid = (await client.create("twins", CreateRequest(region="mad", config=TWIN))).id
            by_digit.setdefault(mid[0], []).append(mid)
            if len(by_digit[mid[0]]) == 2:
                return by_digit
        raise AssertionError(f"17 machines and no first digit twice: {by_digit}")
    finally:
        await client.close()


async def _destroy(url: str, app: str, ids: list[str]) -> None:
    client = await FleetClient.connect(url)
    try:
        for mid in ids:
            await client.destroy(app, mid, force=True)
    finally:
        await client.close()


def test_destroying_a_running_machine_names_the_commands_that_do_it(fleet: tuple[str, str]) -> None:
    url, mid = fleet
    refused = fauxmad(url, "machine", "destroy", mid, "--app", APP)
    assert refused.returncode == 5 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert f"`fauxmad machine stop {mid} -a {APP}`" in refused.stderr and "--force" in refused.stderr


def test_apps_list_shows_an_app_made_by_machine_run(fleet: tuple[str, str]) -> None:
    url, _ = fleet
    listed = json.loads(fauxmad(url, "apps", "list", "--json").stdout)
    assert {"app": APP, "release": None, "status": None, "strategy": None, "regions": {}} in listed
    table = fauxmad(url, "apps", "list").stdout
    assert re.search(rf"{APP}\s+-\s+machines only", table), table


def test_image_ls_is_a_table_and_inspect_says_when_in_iso_8601(fleet: tuple[str, str]) -> None:
    url, _ = fleet
    built = fauxmad(url, "image", "build", str(ROOT / "examples" / "sandwich"), "--tag", "sandwich:v1", "--cmd", "true")
    assert built.returncode == 0, built.stderr
    table = fauxmad(url, "image", "ls").stdout.splitlines()
    header = next(line for line in table if "digest" in line)
    assert header.split() == ["digest", "size", "created", "tags"]
    row = next(line for line in table if "sandwich:v1" in line)
    assert re.search(r"\d[\d,.]* (B|kB|MB)\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row), row
    inspected = json.loads(fauxmad(url, "image", "inspect", "sandwich:v1").stdout)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", inspected["created"]), inspected["created"]


def test_sizes_read_as_people_read_them() -> None:
    assert [human_size(n) for n in (0, 3_970, 12_345, 3_400_000, 2_500_000_000)] == [
        "0 B",
        "3,970 B",
        "12.3 kB",
        "3.4 MB",
        "2.5 GB",
    ]
