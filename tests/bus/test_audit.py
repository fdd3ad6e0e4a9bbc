"""Request signatures (`bus.transport.audit`): what a broker accepts as the identity of a request, and what it refuses."""

from __future__ import annotations

import os

import nkeys
import pytest

from bus.contract.errors import Forbidden
from bus.transport.audit import UNSIGNED, identify, mutating
from bus.transport.signing import RequestSigner

SUBJECT = "fauxmad.v1.api.apps.web.machines.create"
NOW = 1_800_000_000.0


def seed() -> str:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def signer(at: float = NOW) -> RequestSigner:
    return RequestSigner(seed(), "ci-web", clock=lambda: at)


def test_a_signed_request_names_its_key_and_the_name_it_gives() -> None:
    alice = signer()
    caller = identify(SUBJECT, b"{}", alice.headers(SUBJECT, b"{}"), NOW + 1)
    assert caller.identity == f"nkey:{alice.public_key}" and caller.name == "ci-web"
    assert alice.public_key.startswith("U")


def test_no_headers_is_unsigned() -> None:
    assert identify(SUBJECT, b"{}", None, NOW) == UNSIGNED
    assert identify(SUBJECT, b"{}", {"Other": "x"}, NOW) == UNSIGNED


@pytest.mark.parametrize("change", ["payload", "subject", "name", "key", "signature", "time"])
def test_any_change_to_what_was_signed_is_refused(change: str) -> None:
    alice = signer()
    headers = alice.headers(SUBJECT, b"{}")
    subject, data = SUBJECT, b"{}"
    if change == "payload":
        data = b'{"region":"syd"}'
    elif change == "subject":
        subject = "fauxmad.v1.api.apps.other.machines.create"
    elif change == "name":
        headers["Fauxmad-Name"] = "operator"
    elif change == "key":
        headers["Fauxmad-Identity"] = signer().public_key
    elif change == "signature":
        headers["Fauxmad-Signature"] = "not base64 at all!"
    else:
        headers["Fauxmad-Signed-At"] = str(int(NOW * 1000) + 1)
    with pytest.raises(Forbidden, match="does not verify"):
        identify(subject, data, headers, NOW)


def test_a_signature_too_far_from_the_brokers_clock_is_refused() -> None:
    old = signer(at=NOW - 61)
    with pytest.raises(Forbidden, match="signed 61s ago"):
        identify(SUBJECT, b"{}", old.headers(SUBJECT, b"{}"), NOW)
    assert identify(SUBJECT, b"{}", signer(at=NOW - 59).headers(SUBJECT, b"{}"), NOW).name == "ci-web"


def test_reads_are_not_recorded() -> None:
    for verb in ("list", "get", "wait", "snapshots", "simulate"):
        assert not mutating(f"fauxmad.v1.api.apps.web.machines.{verb}")
    for verb in ("create", "destroy", "start", "stop", "update", "exec", "suspend", "resume", "lease", "release"):
        assert mutating(f"fauxmad.v1.api.apps.web.machines.{verb}")
    assert mutating("fauxmad.v1.api.apps.web.jobs.submit.mad") and mutating("fauxmad.v1.api.apps.web.jobs.cancel")
    # a region's own create is signed and recorded, even in a region named like a read verb
    assert mutating("fauxmad.v1.api.apps.web.machines.create.mad") and mutating(
        "fauxmad.v1.api.apps.web.machines.create.get"
    )
    assert not mutating("fauxmad.v1.api.apps.web.jobs.status")
    assert not mutating("fauxmad.v1.worker.mad-w1.machines.start")  # the fleet's own traffic, not the API
