"""The suite's forked commands (`tests.cli_fork`) answer as fresh interpreters do, see only their own environment,
and are killed, with what they started, past their timeout."""

from __future__ import annotations

import socket
import subprocess
import threading

import pytest

from bus.local.ports import free_port
from tests import helpers

pytestmark = pytest.mark.fleet  # CLI processes


def closed_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"


@pytest.mark.parametrize(
    "args",
    [
        ["workers", "--bogus"],
        ["machine", "list", "-a", "web", "--json"],
        ["machine", "run", "--app", "a", "--region", "r", "--cpus", "0", "--", "true"],
        ["secrets", "list", "-a", "Not An App"],
    ],
)
def test_a_forked_command_answers_as_a_fresh_one_does(args: list[str]) -> None:
    url = closed_url()
    forked = helpers.fauxmad(*args, url=url, columns=80)
    fresh = helpers.fauxmad(*args, url=url, columns=80, fresh=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode != 0 and forked.stderr.startswith("fauxmad: "), forked


def test_a_forked_command_sees_its_own_environment_only() -> None:
    told = helpers.fauxmad("workers", env={"FAUXMAD_NATS_URL": closed_url()})
    assert told.returncode == 3 and "cannot reach NATS" in told.stderr, told
    untold = helpers.fauxmad("workers", drop=["FAUXMAD_NATS_URL"], env={"HOME": "/nonexistent"})
    assert untold.returncode == 2 and "no NATS server given" in untold.stderr, untold


def test_a_forked_command_past_its_timeout_is_killed() -> None:
    """A server that accepts and never says INFO: the command waits to connect until the caller's timeout, which
    kills it (its connection closes) and raises TimeoutExpired, as `subprocess.run` does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        accepted: list[socket.socket] = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True)
        thread.start()
        url = f"nats://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(subprocess.TimeoutExpired):
            helpers.fauxmad("workers", url=url, timeout=1.5)
        thread.join(5)
        (conn,) = accepted
        conn.settimeout(5)
        assert conn.recv(1) == b"", "the killed command's connection is still open"
        conn.close()
