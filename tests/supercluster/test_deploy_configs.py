"""The deployed supercluster configs: what the renderer writes, and accepted by nats-server itself (`-t`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bus.local.embedded import find_binary
from bus.local.supercluster import DEPLOY_STORE, deploy_configs
from bus.transport.layout import Layout, from_env
from orchestrator.security.fleetdir import FleetDir

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "supercluster"


def test_the_deployed_files_are_the_renderers_output() -> None:
    rendered = deploy_configs()
    assert sorted(rendered) == sorted(p.name for p in DEPLOY.glob("*.conf"))
    for name, text in rendered.items():
        assert (DEPLOY / name).read_text() == text, (
            f"{name}: run python -m bus.local.supercluster deploy/nats/supercluster"
        )


def test_three_regions_of_three_servers_routes_inside_gateways_between() -> None:
    text = (DEPLOY / "syd-2.conf").read_text()
    assert 'routes: ["nats-route://syd-1:6222", "nats-route://syd-3:6222"]' in text
    assert '{ name: "mad", urls: ["nats://mad-1:7222", "nats://mad-2:7222", "nats://mad-3:7222"] }' in text
    assert '{ name: "gru", urls: ["nats://gru-1:7222", "nats://gru-2:7222", "nats://gru-3:7222"] }' in text
    assert "syd" not in text.split("gateways:")[1]  # never a gateway to its own region
    assert "verify: true" in text  # clients: mutual TLS, as single.conf


@pytest.mark.fleet  # starts processes of its own
@pytest.mark.parametrize("name", sorted(deploy_configs()))
def test_nats_server_accepts_each_config(name: str, tmp_path: Path) -> None:
    fleet = FleetDir(tmp_path / "fleet")
    fleet.init(host="127.0.0.1")  # the CA, certificate and users.conf the config includes
    text = (DEPLOY / name).read_text()
    text = text.replace("/etc/fauxmad/fleet", str(tmp_path / "fleet")).replace(DEPLOY_STORE, str(tmp_path / "js"))
    config = tmp_path / "nats.conf"
    config.write_text(text)
    result = subprocess.run([find_binary(), "-t", "-c", str(config)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "is valid" in result.stderr + result.stdout


def test_the_layout_is_additive_one_server_unless_told() -> None:
    assert from_env({}) == Layout()
    assert Layout().workers_bucket("mad") == "fauxmad_workers"
    assert Layout().events_stream("mad") == "FAUXMAD_EVENTS"
    layout = from_env({"FAUXMAD_SUPERCLUSTER": "mad, syd,gru"})
    assert layout.regions == ("mad", "syd", "gru") and layout.replicas == 3 and layout.home == "mad"
    assert layout.workers_bucket("syd") == "fauxmad_workers_syd"
    assert layout.machines_bucket("syd") == "fauxmad_machines_syd"
    assert layout.idempotency_bucket("syd") == "fauxmad_idempotency_syd"
    assert layout.events_stream("syd") == "FAUXMAD_EVENTS_syd"
    with pytest.raises(ValueError, match="1, 3 or 5"):
        from_env({"FAUXMAD_SUPERCLUSTER": "mad", "FAUXMAD_REPLICAS": "2"})


def test_roles_in_a_supercluster_name_the_regions_own_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.security.roles import Identity, permissions

    worker = Identity(name="syd-w1", role="worker", worker_id="syd-w1", region="syd")
    single = permissions(worker).publish
    assert "$KV.fauxmad_workers.syd.syd-w1" in single  # one server: as before
    monkeypatch.setenv("FAUXMAD_SUPERCLUSTER", "mad,syd")
    publish = permissions(worker).publish
    assert "$KV.fauxmad_workers_syd.syd.syd-w1" in publish and "$KV.fauxmad_machines_syd.*" in publish
    assert "$KV.fauxmad_workers_mad.syd.syd-w1" not in publish  # never into another region's bucket
    assert "$JS.API.DIRECT.GET.KV_fauxmad_machines_mad" in publish  # reads every region's
    broker = permissions(Identity(name="b", role="broker")).publish
    assert {"$KV.fauxmad_idempotency_mad.>", "$KV.fauxmad_idempotency_syd.>"} <= set(broker)
