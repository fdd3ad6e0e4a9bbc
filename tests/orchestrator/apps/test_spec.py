"""The app spec: the README's example and the shipped example parse; the derived machine config is labelled."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from orchestrator.apps.spec import SpecError, load_spec, parse_spec
from tests.helpers import ROOT


def test_the_readme_example_documents_every_field() -> None:
    readme = (ROOT / "docs" / "reference" / "fauxmad-toml.md").read_text()
    block = re.search(r"```toml\n(app = .*?)```", readme, re.S)  # the app spec (not the fleets file)
    assert block is not None
    spec = parse_spec(block.group(1), "fauxmad-toml.md")
    assert spec.app == "sandwich" and spec.regions == {"mad": 3, "syd": 2}
    assert spec.deploy.unavailable_budget(3) == 1 and spec.deploy.unavailable_budget(10) == 4
    assert spec.checks["http"].port is None and spec.deploy.wait_seconds == 60  # the check finds $PORT
    # it is the shipped example, whose app.py sits next to it: the default working directory
    shipped = load_spec(ROOT / "examples" / "sandwich" / "fauxmad.toml")
    assert msgspec.structs.replace(shipped, workdir=None) == msgspec.structs.replace(spec, workdir=None)
    assert shipped.workdir == str(ROOT / "examples" / "sandwich")
    assert (Path(shipped.workdir) / shipped.cmd[1]).is_file()


def test_the_shipped_example_parses_and_labels_its_machines() -> None:
    spec = load_spec(ROOT / "examples" / "fauxmad.toml")
    config = spec.machine_config(7, "spare", standby_of="0123456789abcd")
    assert config.metadata == {"fauxmad_release": "7", "fauxmad_role": "spare"}
    assert config.standbys == ["0123456789abcd"] and config.cmd == spec.cmd
    assert config.workdir == spec.workdir == str(ROOT / "examples")


@pytest.mark.parametrize(
    ("line", "where"),
    [("", "app"), ('workdir = "."', "app"), ('workdir = "../data"', "data"), ('workdir = "/srv/x"', "/srv/x")],
)
def test_workdir_is_relative_to_the_spec_files_directory(tmp_path: Path, line: str, where: str) -> None:
    for name in ("app", "data"):
        (tmp_path / name).mkdir()
    path = tmp_path / "app" / "fauxmad.toml"
    path.write_text(f'app = "x"\ncmd = ["./run"]\n{line}\n[regions]\nmad = 1\n')
    if where.startswith("/"):
        with pytest.raises(SpecError, match="`workdir`: /srv/x is not a directory"):
            load_spec(path)
        return
    spec = load_spec(path)
    assert spec.workdir == str(tmp_path / where)
    assert spec.machine_config(1, "primary").workdir == spec.workdir


def test_a_spec_without_a_file_keeps_the_machines_own_directory() -> None:
    spec = parse_spec('app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n')
    assert spec.workdir is None and spec.machine_config(1, "primary").workdir is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('app = "x"\ncmd = []\n[regions]\nmad = 1\n', "`cmd`"),
        ('app = "x"\ncmd = ["a"]\n', "[regions] needs at least one"),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n[deploy]\nmax_unavailable = 1.5\n', "max_unavailable"),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n[deploy]\nstrategy = "yolo"\n', "`deploy.strategy`"),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n[deploy]\nwait_timeout = "soon"\n', "wait_timeout"),
        ('app = "a.b"\ncmd = ["a"]\n[regions]\nmad = 1\n', "`app`"),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = -1\n', "`regions.mad`"),
        ('app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n[placement]\npreset = "packed"\n', "`placement.preset`"),
        # a key of a table written at the top: the table it belongs under (issue 41)
        ('app = "x"\ncmd = ["a"]\ncpus = 2\n[regions]\nmad = 1\n', "unknown key `cpus` (it belongs under [guest])"),
        ('app = "x"\ncmd = ["a"]\nstrategy = "canary"\n[regions]\nmad = 1\n', "(it belongs under [deploy])"),
    ],
)
def test_bad_specs_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(text)
    message = str(caught.value)
    assert needle in message and "\n" not in message


def test_the_placement_preset_is_optional_and_one_of_the_brokers_presets() -> None:
    base = 'app = "x"\ncmd = ["a"]\n[regions]\nmad = 1\n'
    assert parse_spec(base).placement.preset is None
    assert parse_spec(base + '[placement]\npreset = "spread"\n').placement.preset == "spread"


def test_a_missing_file_is_a_plain_error() -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(ROOT / "nope" / "fauxmad.toml")
