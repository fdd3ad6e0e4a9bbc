"""Fixtures: a real nats-server (JetStream on) per session, and factories for real workers.

The session starts by compiling the project's modules: a host that sets `PYTHONDONTWRITEBYTECODE` (this
CI's does) otherwise has every worker and CLI process the tests start compile them again, a tenth of a
second or more each (test_first_hour.py: 62 s without, 53 s with).
"""

from __future__ import annotations

import compileall
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bus.embedded import EmbeddedNats
from tests.helpers import WorkerProcess

_ids = itertools.count(1)
ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session: pytest.Session) -> None:
    for package in ("bus", "orchestrator", "workers", "tests"):
        compileall.compile_dir(ROOT / package, quiet=1, workers=0)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(name="fauxmad-tests") as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def fresh_nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(name="fauxmad-test-fresh") as server:
        yield server


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Unique names per test, so tests can share one nats-server without seeing each other."""
    run = next(_ids)

    def make(prefix: str) -> str:
        return f"{prefix}{run}x{next(_ids)}"

    return make


@pytest.fixture
def worker_factory(
    tmp_path: Path, nats_url: str, unique: Callable[[str], str]
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def make(
        region: str | None = None,
        *,
        url: str | None = None,
        worker_id: str | None = None,
        cpus: int = 4,
        memory_mb: int = 4096,
        extra: list[str] | None = None,
    ) -> WorkerProcess:
        wid = worker_id or unique("w")
        worker = WorkerProcess(
            url or nats_url, region or unique("r"), wid, tmp_path / wid, cpus=cpus, memory_mb=memory_mb, extra=extra
        )
        started.append(worker)
        return worker.start()

    yield make
    for worker in started:
        worker.cleanup()
