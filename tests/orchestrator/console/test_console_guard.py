"""The console's same-origin rules as pure functions (`orchestrator.console.guard`): which requests may act, which
origin a request addressed, which peers' forwarding headers count; and the HTTPS certificate a secure fleet's API
identity is issued (files only, no server). The fleet tests (test_console_csrf) show the same rules on a real API
and in a real browser."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from orchestrator.api.run import fleet_certificate, https_files, tls_context
from orchestrator.console.guard import (
    FORM,
    JSON,
    Asked,
    TrustedProxies,
    csrf_key,
    csrf_token,
    given_origin,
    normal_origin,
    parse_proxy,
    refusal,
)
from orchestrator.security.fleetdir import FleetDir
from orchestrator.security.pki import server_names

OWN = "http://127.0.0.1:4280"
KEY = csrf_key(b"k" * 32, None)
TOKEN = csrf_token(KEY, "fm1_session")


def page(**changes: object) -> Asked:
    """What the console's own page sends for an action, with `changes`."""
    fields: dict[str, object] = {
        "own": OWN,
        "origin": OWN,
        "fetch_site": "same-origin",
        "content_type": JSON,
    }
    fields.update(changes)
    return Asked(**fields)  # type: ignore[arg-type]


def test_the_pages_own_action_passes() -> None:
    assert refusal(page(), wants=JSON, token=TOKEN, expected=TOKEN) is None
    assert refusal(page(fetch_site=None), wants=JSON, token=TOKEN, expected=TOKEN) is None  # an older browser
    assert refusal(page(origin=None), wants=JSON, token=TOKEN, expected=TOKEN) is None  # Sec-Fetch-Site says it


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"origin": "http://127.0.0.1:9000", "fetch_site": "same-site"}, "same-site request may not act"),
        ({"origin": "http://127.0.0.1:9000", "fetch_site": None}, "origin http://127.0.0.1:9000 may not act"),
        ({"origin": "http://localhost:4280", "fetch_site": None}, "origin http://localhost:4280 may not act"),
        ({"origin": "https://127.0.0.1:4280", "fetch_site": None}, "this console is http://127.0.0.1:4280"),
        ({"origin": "null", "fetch_site": None}, "origin null may not act"),
        ({"origin": "http://evil.example", "fetch_site": "cross-site"}, "cross-site request may not act"),
        ({"origin": None, "fetch_site": None}, "without an Origin header"),
        ({"fetch_site": "none"}, "Sec-Fetch-Site: none"),
        ({"content_type": "text/plain"}, "Content-Type text/plain refused: this takes application/json"),
        ({"content_type": FORM}, "Content-Type application/x-www-form-urlencoded refused"),
        ({"content_type": ""}, "Content-Type none refused"),
    ],
)
def test_a_request_not_from_the_consoles_own_page_is_refused_saying_why(changes: dict[str, object], said: str) -> None:
    why = refusal(page(**changes), wants=JSON, token=TOKEN, expected=TOKEN)
    assert why is not None and said in why, why
    assert "\n" not in why


def test_the_token_is_the_sessions_own() -> None:
    assert "no anti-CSRF token" in (refusal(page(), wants=JSON, token=None, expected=TOKEN) or "")
    assert "no anti-CSRF token" in (refusal(page(), wants=JSON, token="", expected=TOKEN) or "")
    other = csrf_token(KEY, "fm1_another_session")
    assert "wrong anti-CSRF token" in (refusal(page(), wants=JSON, token=other, expected=TOKEN) or "")
    assert csrf_token(KEY, "fm1_session") == TOKEN  # the same for every process holding the same secret
    assert csrf_token(csrf_key(b"j" * 32, None), "fm1_session") != TOKEN
    assert csrf_key(None, None) != csrf_key(None, None)  # an open API: a random key per process
    assert refusal(page(), wants=FORM, token=None, expected=None) is not None  # login: its media type still counts


def test_a_bearer_client_without_a_cookie_needs_only_the_media_type() -> None:
    script = page(origin=None, fetch_site=None, bearer_only=True)
    assert refusal(script, wants=JSON, token=None, expected=TOKEN) is None
    assert refusal(page(origin="http://evil.example", bearer_only=True), wants=JSON, token=None, expected=TOKEN) is None
    why = refusal(page(origin=None, fetch_site=None, bearer_only=True, content_type="text/plain"), wants=JSON,
                  token=None, expected=TOKEN)  # fmt: skip
    assert why is not None and "text/plain" in why


def test_origins_are_compared_in_one_spelling() -> None:
    assert normal_origin("HTTP", "LocalHost:80") == "http://localhost"
    assert normal_origin("https", "example.com:443") == normal_origin("https", "example.com")
    assert normal_origin("https", "example.com:8443") == "https://example.com:8443"
    assert normal_origin("http", "[::1]:4280") == "http://[::1]:4280"
    assert given_origin("http://127.0.0.1:4280") == OWN
    for bad in ("null", "127.0.0.1:4280", "ftp://x", "http://a/b", "http://u@h", "http://h:99999"):
        assert given_origin(bad) is None, bad
    assert normal_origin("http", "") is None


def test_only_the_named_proxies_are_trusted() -> None:
    trusted = TrustedProxies([parse_proxy("10.0.0.0/8"), parse_proxy("::1")])
    assert "10.1.2.3" in trusted and "::1" in trusted
    assert "127.0.0.1" not in trusted and None not in trusted and "not-an-ip" not in trusted
    assert "127.0.0.1" not in TrustedProxies()
    with pytest.raises(ValueError, match="not an IP address or a CIDR"):
        parse_proxy("proxy.example")


def test_an_api_identity_gets_an_https_certificate_from_the_fleets_ca(tmp_path: Path) -> None:
    """What `fauxmad api` serves on a secure fleet by default: a server certificate for the NATS server's names,
    from the fleet's CA, beside the api identity's credentials (none for other roles), renewed by `rotate` and gone
    with the identity."""
    fleet = FleetDir(tmp_path / "fleet")
    fleet.init(host="127.0.0.1", port=4222)
    fleet.add_user("api-1", "api")
    fleet.add_user("reader", "viewer")
    creds = fleet.creds("api-1")
    found = fleet_certificate("tls://127.0.0.1:4222", str(creds))
    assert found == https_files("api-1", creds.parent) and found is not None
    cert = x509.load_pem_x509_certificate(found[0].read_bytes())
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert sorted(server_names(found[0])) == sorted(server_names(fleet.root / "server.pem"))
    ca = x509.load_pem_x509_certificate((fleet.root / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    tls_context(*found)  # the pair loads as a server's

    assert fleet_certificate("tls://127.0.0.1:4222", str(fleet.creds("reader"))) is None
    assert fleet_certificate("nats://127.0.0.1:4222", str(creds)) is None  # an open fleet: no identity
    before = found[0].read_bytes()
    fleet.rotate(["api-1"])
    assert found[0].read_bytes() != before
    fleet.remove("api-1")
    assert not found[0].exists() and not found[1].exists()
